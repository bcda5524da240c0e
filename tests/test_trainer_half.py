"""experiments/trainer_half.py: the trainer half with no engine orders the formats."""
import pytest

import task
import trainer_half
from precision import INIT_SCALE


def test_trainer_half_needs_no_engine_and_orders_the_formats():
    """trainer_half.py (the GPU check where vLLM is not): the held-out answers' tokens, each 16-bit
    trainer against float32 on this CPU; fp16's log-prob error and its logits' are a fraction of
    bf16's; the loss scale brings fp16's gradient nearer float32's; --by-part splits it; no GPU, so
    no cross rows and no --gpu-ablation."""
    result = trainer_half.main(["--by-part"])
    assert result["tokens"] == task.N_EVAL * (2 * 12 - 1 + 1) and not result["cross_rows"]
    err = {r["trainer"]: r["mismatch_logp_abs_mean"] for r in result["rows"] if r["device"] == "cpu"}
    assert 0 < 2 * err["fp16"] < err["bf16"], err
    layers = result["layers"]["cpu"]
    assert all(0 < e < 1 for e in layers["bf16"] + layers["fp16"]) and layers["fp16"][-1] < layers["bf16"][-1]
    grads = {(g["trainer"], g["loss_scale"]): g for g in result["grads"]}
    assert grads["fp16", INIT_SCALE]["rel_error"] < grads["fp16", 1.0]["rel_error"], grads
    parts = grads["bf16", 1.0]["by_part"]
    assert abs(sum(r["share"] for r in parts.values()) - 1) < 1e-9
    assert set(parts) == {*trainer_half.PARTS, "norms"} and all(0 < r["rel_error"] < 1 for r in parts.values())
    with pytest.raises(SystemExit) as refused:  # the GPU's kernels swapped: on a GPU alone
        trainer_half.main(["--gpu-ablation", "both"])
    assert refused.value.code == 2 and result["gpu_ablation"] == "none"


def test_the_trainers_sites_round_to_nearest_here():
    """--sites (rounding.py's probe for the trainer's own two sites): on this CPU the 16-bit
    trainer's rotary and attention outputs are the float32 results rounded to nearest, the side
    sites.py's modes change; bf16 truncation matches about half, as chance has it; no bias in
    size. SDPA's plain math kernel is one of the kernels read beside them."""
    with pytest.raises(SystemExit) as refused:  # no checkpoint, no gradient: one line, exit 2
        trainer_half.main(["--sites", "--by-part"])
    assert refused.value.code == 2
    ops = trainer_half.main(["--sites"])["ops"]
    for site in ("rotary", "attention"):
        for label in ("bf16", "fp16"):
            row = ops[site][label]
            assert row["match_nearest"] > 0.998 and abs(row["magnitude_bias"]) < 1e-4, (site, row)
        assert 0.4 < ops[site]["bf16"]["match_truncation"] < 0.6, ops[site]
    assert ops["rotary"]["bf16"]["match_nearest"] == 1.0 and ops["attention_math"]["on_model_path"] is False
