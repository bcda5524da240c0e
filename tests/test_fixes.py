"""experiments/fixes.py: each fix's paired row and cost beside its RL result, from one machine."""
import json
import os

import pytest

import fixes
from common import machine_line

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
MODES = [("bf16", "bf16"), ("fp16", "fp16"), ("bf16+head32", "bf16+head32"), ("fp32", "bf16"),
         ("fp32", "fp32"), ("bf16", "bf16-aligned")]


def probe_json(path):
    """The probe's JSON (mismatch.py) with hand-set rows: each pair's mismatch 1e-4 x its index."""
    rows = [{"engine": e, "trainer": t, "mismatch_logp_abs_mean": 1e-4 * (i + 1),
             "over_bf16": {"ratio": i + 1.0, "ci95": [i + 0.5, i + 1.5]}} for i, (e, t) in enumerate(MODES)]
    speed = {"bf16": 100.0, "fp16": 50.0, "bf16+head32": 90.0, "fp32": 80.0}
    cost = {"bf16": 2.0, "fp16": 2.0, "bf16+head32": 2.2, "fp32": 1.0, "bf16-aligned": 2.4}
    json.dump({"paired_rows": rows, "engine_tokens_per_s": speed, "trainer_fwd_bwd_s": cost,
               "machine": MACHINE}, open(path, "w"))


def test_each_fix_has_its_paired_row_cost_and_rl_result(tmp_path):
    probe, exp_path, out = (os.path.join(tmp_path, f) for f in ("probe.json", "exp.json", "fixes.json"))
    probe_json(probe)
    d = {"n": 2, "mean": 0.1, "se": 0.05, "ci95": [-0.5, 0.7], "p_sign_flip": 0.5}
    exp = {"machine": machine_line(MACHINE),
           "arms": {"arm": {"bf16": {}, "fp16": {"reward_last10_minus_bf16": d}}}}
    json.dump(exp, open(exp_path, "w"))
    fixes.main([probe, exp_path, "--out", out])
    table = {e["fix"]: e for e in json.load(open(out))["fixes"]}
    assert table["fp16"]["rl"] == {"arm": d} and table["bf16"]["rl"] == {"arm": None}
    assert table["bf16-aligned"]["mismatch_logp_abs_mean"] == pytest.approx(6e-4)  # its pair's row
    assert table["bf16-engine32"]["over_bf16"]["ratio"] == 4.0  # the fp32 engine, bf16 trainer
    assert table["fp16"]["engine_speed_vs_bf16"] == 0.5 and table["bf16-aligned"]["trainer_time_vs_bf16"] == 1.2
    json.dump({**exp, "machine": "another chip"}, open(exp_path, "w"))
    with pytest.raises(SystemExit) as e:  # an offline row and an RL result of two chips are not one fix's
        fixes.main([probe, exp_path, "--out", out])
    assert e.value.code == 2
