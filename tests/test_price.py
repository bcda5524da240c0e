"""experiments/price.py: the cheap fix's price. Its readings are ratios paired by round, by hand;
its rounds time every trainer after a warm-up and leave the trainer as it was. No timing is
asserted: timings are benchmarks (price.md), not tests."""
import pytest
import torch

import model
import precision
import price
import sites


@pytest.fixture
def restore(monkeypatch):
    """sites.use(None) puts its three names back but leaves the mode set: put that back too."""
    monkeypatch.setattr(sites.SiteRounding, "mode", sites.SiteRounding.mode)


def test_ratios_pair_each_round_and_the_arithmetic_is_trunc_over_the_hooks():
    """trunc over bf16 is 2, 1, 2 by round (median 2, quartiles 1.5 and 2), where the ratio of
    the medians would read 1; the hooks 1.1 every round; the arithmetic trunc over the hooks."""
    times = {"bf16": [1.0, 2.0, 4.0], "bf16-site-rne": [1.1, 2.2, 4.4],
             "bf16-site-trunc": [2.0, 2.0, 8.0], "bf16-aligned": [0.5, 1.0, 2.0]}
    out = price.ratios(times)
    assert out["bf16-site-trunc / bf16"] == pytest.approx([2.0, 1.5, 2.0])
    assert out["bf16-site-rne / bf16"] == pytest.approx([1.1, 1.1, 1.1])
    assert out["bf16-aligned / bf16"] == pytest.approx([0.5, 0.5, 0.5])
    assert out["bf16-site-trunc / bf16-site-rne"] == pytest.approx([2 / 1.1, 1.5 / 1.1, 2 / 1.1])
    times["bf16-site-sym"] = times.pop("bf16-site-trunc")  # --mode sym: its arithmetic, read so
    sym = price.ratios(times, "sym")
    assert sym["bf16-site-sym / bf16-site-rne"] == out["bf16-site-trunc / bf16-site-rne"]
    assert "bf16-site-trunc / bf16-site-rne" not in sym


def test_time_rounds_times_each_trainer_every_round_in_turn_and_restores_the_trainer(restore,
                                                                                     monkeypatch):
    """Three rounds after the warm-up, each starting one trainer later: the site modes installed
    (None: the trainer as it is) follow the rotation, and the names are back afterwards."""
    torch.manual_seed(0)
    cfg = model.GPTConfig(n_layer=1, n_head=2, n_embd=64, n_hidden=128, max_seq_len=16)
    gpt, idx = model.GPT(cfg), torch.randint(0, cfg.vocab_size, (2, 8))
    original = (precision.TensorCoreMatmuls, model.apply_rope, model.GPT.forward)
    installed, use = [], sites.use
    monkeypatch.setattr(sites, "use", lambda mode: installed.append(mode) or use(mode))
    trainers = price.trainers("sym")
    times = price.time_rounds(gpt, idx, trainers, 3)
    modes = [m for _, m, _ in trainers]  # None, rne, sym, None
    want = [m for r in range(4) for m in modes[r:] + modes[:r]] + [None]
    assert installed == want and modes[2] == "sym" and price.TRAINERS[2][1] == "trunc"
    assert list(times) == [name for name, _, _ in trainers]
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())
    assert (precision.TensorCoreMatmuls, model.apply_rope, model.GPT.forward) == original
