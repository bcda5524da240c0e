"""experiments/campaign_figure.py: real runs drawn, each run's variant read from its args.json."""
import json
import os

import campaign_figure


def test_the_campaign_figure_draws_real_runs(dtype_runs, warm_dir):
    """campaign_figure.py reads each run's variant from args.json (one seed each: no s.e.)."""
    exp, runs = dtype_runs
    campaign_figure.main([exp, "--out", os.path.join(warm_dir, "exp.png")])
    drawn = json.load(open(os.path.join(warm_dir, "exp.json")))["arms"]["grpo"]
    assert sorted(drawn) == ["bf16", "fp16", "fp32"]
    assert drawn["fp16"]["curves"]["reward_mean"]["mean"] == [r["reward_mean"] for r in runs["fp16"]]
    assert open(os.path.join(warm_dir, "exp.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
