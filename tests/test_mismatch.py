"""experiments/mismatch.py: the mismatch probe on the real engines, every fix's row, and the quick
probe of a policy."""
import json
import os

import pytest

import mismatch


def argv(*extra):
    return ["--group-size", "4", *extra]


def test_offline_probe_orders_every_engine_and_trainer(engine, warm_dir, monkeypatch):
    """Every engine x trainer pair on the (tiny) warm start, on 32 held-out prompts: the matched 16-bit
    rows order as the formats' precision says; on identical tokens (paired), bf16 against bf16 is the
    unit and fp16's mismatch is a fraction of it; the fp32 engine agrees with itself (decode, prefill); the
    trainers on the engine's kernels leave under 1 % of the emulated trainers' mismatch (0 where the engine's
    GEMM is batch-invariant: fp16 here)."""
    out = os.path.join(warm_dir, "probe.json")
    mismatch.main(argv("--json", out), engine)
    result = json.load(open(out))
    rows = {(r["engine"], r["trainer"]): r for r in result["rows"]}
    assert len(rows) == 9 + 4 + 2 and result["sequences_per_engine"] == 32 * 4 and result["machine"]["torch"]
    k3 = {pair: r["mismatch_k3"] for pair, r in rows.items()}
    assert k3[("fp32", "fp32")] * 100 <= k3[("fp16", "fp16")] < k3[("bf16", "bf16")], k3
    assert k3[("bf16", "fp32")] > k3[("fp16", "fp32")] > k3[("fp32", "fp32")], k3  # engine-side rounding alone
    paired_rows = {(r["engine"], r["trainer"]): r for r in result["paired_rows"]}
    paired = {pair: r["over_bf16"] for pair, r in paired_rows.items()}
    assert set(paired) == set(rows)
    assert paired[("bf16", "bf16")]["ratio"] == pytest.approx(1.0)
    assert paired[("fp16", "fp16")]["ci95"][1] < 1 and paired[("fp32", "fp32")]["ratio"] < 0.01
    # the fp32 LM head leaves the body's 16-bit rounding: far more mismatch than fp32 on both sides
    assert paired[("bf16+head32", "bf16+head32")]["ci95"][0] > 10 * paired[("fp32", "fp32")]["ratio"]
    self_rows = {r["engine"]: r for r in result["self_rows"]}
    assert set(self_rows) == set(mismatch.ENGINES) and self_rows["fp32"]["mismatch_logp_abs_mean"] < 1e-6
    for name in ("bf16", "fp16"):
        plain, aligned = (rows[(name, t)]["mismatch_logp_abs_mean"] for t in (name, f"{name}-aligned"))
        assert aligned <= 0.01 * plain and paired[(name, f"{name}-aligned")]["ratio"] <= 0.01
    assert rows[("fp16", "fp16-aligned")]["mismatch_logp_abs_mean"] == 0
    assert set(result["engine_tokens_per_s"]) == set(mismatch.ENGINES) and set(result["trainer_fwd_bwd_s"]) == {*mismatch.ENGINES, "bf16-aligned"}


def test_quick_probe_reads_a_policy_in_bf16_and_fp16_with_layer_errors(engine, warm_dir):
    """mismatch.py --quick (the campaign's cross-probe of a trained policy): the three dtypes' engines, each with
    its matched and aligned trainer, no costs; per layer, every 16-bit mode's error against float32
    is positive, and bf16's logits are further off than fp16's."""
    result = mismatch.main(argv("--quick", "--group-size", "2"), engine)
    pairs = {(r["engine"], r["trainer"]) for r in result["paired_rows"]}
    assert pairs == {("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "bf16-aligned"), ("fp16", "fp16"), ("fp16", "fp16-aligned")}
    assert not result["trainer_fwd_bwd_s"] and result["seed"] == 0
    layers = result["layers"]
    assert set(layers) == {"bf16", "fp16", "bf16-aligned", "fp16-aligned"}
    assert all(len(e) == 4 + 2 and all(0 < x < 1 for x in e) for e in layers.values())
    assert layers["bf16"][-1] > layers["fp16"][-1] and layers["bf16-aligned"][-1] > layers["fp16-aligned"][-1]
