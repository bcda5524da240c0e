"""experiments/anatomy.py: the temperature fit, the correlation along a sequence, the length test
and GSPO's window by hand, and the real anatomy on the shared engines."""
import math

import pytest
import torch

import anatomy


def test_the_temperature_fit_recovers_a_known_flattening():
    """log mu = log_softmax(z / tau) against log pi = log_softmax(z): to first order in tau - 1,
    the fit gives tau back (here 1.001, a slightly flatter engine) with an interval around it."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 9, 20, generator=g) * 3
    idx = torch.randint(0, 20, (64, 10), generator=g)
    mask = torch.ones(64, 9)
    logp = lambda t: torch.gather(torch.log_softmax(z / t, -1), -1, idx[:, 1:, None]).squeeze(-1)  # noqa: E731
    fit = anatomy.temperature(logp(1.001) - logp(1.0), z, idx, mask)
    assert fit["tau"] == pytest.approx(1.001, abs=2e-5) and fit["ci95"][0] < fit["tau"] < fit["ci95"][1]


def test_lag1_and_the_window_by_hand():
    """Alternating signs along a sequence correlate -1 with the next position; a sequence log-ratio
    of 1e-3 is outside GSPO's [log(1 - 3e-4), log(1 + 4e-4)], 1e-4 inside; the bias is their mean."""
    d = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, -2.0, 2.0, -2.0]]) * 1e-3
    mask = torch.ones(2, 4)
    assert anatomy.lag1(d, mask) == pytest.approx(-1.0)
    d = torch.tensor([[-1e-3] * 4, [-1e-4] * 4])  # log pi - log mu = +1e-3 and +1e-4 a token
    w = anatomy.window(d, mask)
    assert w["outside"] == 0.5 and w["seq_logratio_mean"] == pytest.approx(5.5e-4)
    assert w["outside_bias_alone"] == 1.0 and w["outside_noise_alone"] == 1.0  # +-4.5e-4: both out


def test_the_length_test_by_hand():
    """Each sequence predicted by its own token variance over its length: means 2, 2, 5 (their
    variance 3) against (2/2 + 12/3 + (20/3)/4) / 3 = 20/9, ratio 1.35; one token left out."""
    rows = [[1, 3], [0, 0, 6], [5], [4, 6, 8, 2]]
    d, mask = torch.zeros(4, 4), torch.zeros(4, 4)
    for i, row in enumerate(rows):
        d[i, :len(row)], mask[i, :len(row)] = torch.tensor(row, dtype=torch.float), 1
    L = anatomy.length_test(d, mask)
    assert L["sequences"] == 3 and L["seq_mean_var"] == pytest.approx(3)
    assert L["iid_var"] == pytest.approx(20 / 9) and L["ratio"] == pytest.approx(1.35)


def test_the_length_test_reads_1_for_independent_tokens_above_1_for_an_offset():
    """Independent tokens whose spread grows with their sequence's length (2 to 64 tokens): the
    interval holds 1, where one pooled token variance would predict too much for the short
    sequences and read about 0.3. A per-sequence offset of the tokens' size: above 1."""
    g = torch.Generator().manual_seed(0)
    n = torch.randint(2, 65, (4096,), generator=g)
    mask = (torch.arange(64) < n[:, None]).float()
    noise = torch.randn(4096, 64, generator=g) * n[:, None] / 32 * mask
    L = anatomy.length_test(noise, mask)
    assert L["ci95"][0] < 1 < L["ci95"][1] and abs(L["ratio"] - 1) < 0.1
    pooled = noise[mask.bool()].var() / n.double()
    per_seq = (noise.sum(1) / n).var()
    assert per_seq / pooled.mean() < 0.4  # the pooled prediction's reading, for contrast
    offset = torch.randn(4096, 1, generator=g) * mask
    assert anatomy.length_test(noise + offset, mask)["ci95"][0] > 1


def test_the_anatomy_reads_both_formats_on_identical_tokens(engine):
    """On the (tiny) warm start: fp16's mismatch a fraction of bf16's on the same tokens; every
    figure present and finite."""
    result = anatomy.main(["--group-size", "2"], engine)
    bf16, fp16 = (result["variants"][v] for v in ("bf16", "fp16"))
    assert 0 < fp16["logp_abs_mean"] < bf16["logp_abs_mean"] / 2
    for r in (bf16, fp16):
        assert math.isfinite(r["tau"]["tau"]) and -1 <= r["lag1_correlation"] <= 1
        assert sum(b["tokens"] for b in r["by_pi"]) == result["tokens"]
