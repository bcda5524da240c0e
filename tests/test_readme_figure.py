"""experiments/readme_figure.py: the README's figure draws a campaign JSON's numbers, seed by seed."""
import json
import os

import pytest

import readme_figure


def cell(seeds, heldout, level):
    curve = {"x": [0, 1], "mean": [level, level / 2], "se": [0.0, 0.0]}
    return {"seeds": seeds, "n": len(seeds), "heldout": heldout,
            "curves": {"mismatch_logp_abs_mean": curve}}


def test_the_figure_pairs_each_seeds_bf16_and_fp16_and_refuses_a_campaign_without_the_arm(tmp_path):
    d = {"n": 2, "mean": 0.02, "se": 0.01, "ci95": [-0.1, 0.14], "p_sign_flip": 0.5}
    arm = {"fp32": cell([0, 1], [0.9, 0.9], 1e-8), "bf16": cell([1, 0], [0.8, 0.7], 2e-4),
           "fp16": {**cell([0, 1], [0.75, 0.8], 2e-5), "heldout_minus_bf16": d}}
    path, out = os.path.join(tmp_path, "exp.json"), os.path.join(tmp_path, "readme.png")
    json.dump({"machine": "chip", "arms": {readme_figure.ARM: arm}}, open(path, "w"))
    readme_figure.main([path, "--out", out])
    drawn = json.load(open(out[:-4] + ".json"))
    assert drawn["heldout"] == {"seeds": [0, 1], "bf16": [0.7, 0.8], "fp16": [0.75, 0.8]}
    assert drawn["mismatch"]["bf16"]["mean"] == [2e-4, 1e-4] and drawn["heldout_minus_bf16"] == d
    json.dump({"machine": "chip", "arms": {"grpo": arm}}, open(path, "w"))
    with pytest.raises(SystemExit) as e:
        readme_figure.main([path, "--out", out])
    assert e.value.code == 2
