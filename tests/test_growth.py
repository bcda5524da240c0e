"""experiments/growth.py: the cross-probe's paired log ratios by hand."""
import math

import pytest

import growth
from results import probe_figures


def test_cross_probe_by_hand(capsys):
    """A probed policy's figures (probe_figures) and the cross-probe's paired log ratios (print_cross), on two seeds by hand:
    bf16-trained / fp16-trained is 2 and 4 in bf16, 1 and 2 in fp16; the unsure share is the fp32 row's pi < 0.9."""
    def probe(bf16, fp16, low):
        row = lambda mode, m: {"engine": mode, "trainer": mode, "mismatch_logp_abs_mean": m,  # noqa: E731
                               "pi_bucket_frac": [low / 2, low / 2, 0.1, 0.4, 0.5 - low]}
        return {"paired_rows": [row("fp32", 1e-8), row("bf16", bf16), row("fp16", fp16)], "layers": None}
    p = probe_figures(probe(4e-4, 2e-5, 0.01))
    assert (p["probe_bf16"], p["probe_fp16"]) == (4e-4, 2e-5) and p["probe_low_pi_frac"] == pytest.approx(0.01)
    cell = lambda pols: {"seeds": [0, 1], "n": 2, **{k: [x[k] for x in pols] for k in pols[0]}}  # noqa: E731
    out = {"arms": {"arm": {"warm start": cell([probe_figures(probe(1e-4, 1e-5, 0.01))] * 2),
                            "bf16": cell([probe_figures(probe(2e-4, 2e-5, 0.02)), probe_figures(probe(4e-4, 4e-5, 0.02))]),
                            "fp16": cell([probe_figures(probe(1e-4, 2e-5, 0.01)), probe_figures(probe(1e-4, 2e-5, 0.01))])}}}
    growth.print_cross(out)
    d = out["arms"]["arm"]["bf16"]
    assert d["cross_bf16"]["mean"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert d["cross_fp16"]["mean"] == pytest.approx((0 + math.log(2)) / 2)
    assert d["cross_excess"]["mean"] == pytest.approx(math.log(2)) and d["cross_excess"]["se"] == pytest.approx(0)
    assert "in bf16 minus the same in fp16: +0.693" in capsys.readouterr().out
