"""experiments/redraw.py: how far each rounding mode moves the trainer's log-probs from rne's.
Measured on the random model, no engine: the nudge's doses redraw in the order of the share they
move, a rule at the head alone redraws less than the same rule at every matmul, the trainer is
left as it was; a bad --modes is refused in one line."""
import subprocess
import sys

import model
import precision
import redraw
import sites
from conftest import ROOT


def test_the_redraw_grows_with_the_share_moved_and_with_where_the_rule_acts(random_ckpt):
    modes = ("rne", "trunc", "nudge16", "nudge8", "nudge", "nudge-head", "nudge-matmuls")
    out = redraw.redraw(random_ckpt, modes=modes)
    assert list(out) == list(modes[1:])  # rne is the reference, not a row
    assert all(0 < r["mean_abs"] and 0 < r["margin_abs"] and 0 < r["top_share"] <= 1
               for r in out.values())
    by = {m: out[m]["mean_abs"] for m in out}
    assert by["nudge16"] < by["nudge8"] < by["nudge"], by
    assert by["nudge-head"] < by["nudge-matmuls"], by
    assert precision.TensorCoreMatmuls is sites.ORIGINAL["trainer"]
    assert model.GPT.forward is sites.ORIGINAL["forward"]


def test_modes_without_trunc_are_refused_in_one_line_before_any_work():
    cmd = [sys.executable, "experiments/redraw.py", "--modes", "rne", "sym"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
