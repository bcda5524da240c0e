"""experiments/readme_figure.py: the README's figure draws a campaign JSON's mismatch curves and the
causal JSONs' runs, seed by seed, and refuses JSON without the arm or a variant it draws."""
import json
import os

import pytest

import readme_figure


def cell(seeds, heldout, level):
    curve = {"x": [0, 1], "mean": [level, level / 2], "se": [0.0, 0.0]}
    return {"seeds": seeds, "n": len(seeds), "heldout": heldout,
            "curves": {"mismatch_logp_abs_mean": curve}}


def causal(variants):
    cells = {v: {"seeds": [0, 1], "heldout": [0.9, h], "fell": int(h < 0.5)} for v, h in variants.items()}
    return {"machine": "chip", "arms": {readme_figure.ARM: {"variants": cells}}}


def test_the_figure_draws_each_runs_heldout_by_chip_and_refuses_what_it_lacks(tmp_path, capsys):
    arm = {"fp32": cell([0, 1], [0.9, 0.9], 1e-8), "bf16": cell([1, 0], [0.8, 0.7], 2e-4),
           "fp16": cell([0, 1], [0.75, 0.8], 2e-5)}
    paths = [os.path.join(tmp_path, f) for f in ("exp.json", "avx2.json", "amx.json")]
    out = os.path.join(tmp_path, "readme.png")
    json.dump({"machine": "chip", "arms": {readme_figure.ARM: arm}}, open(paths[0], "w"))
    json.dump(causal({"bf16": 0.1, "bf16-aligned": 0.95, "fp16": 0.96}), open(paths[1], "w"))
    json.dump(causal({"bf16": 0.95, "bf16-trunc": 0.2, "bf16-trunc-aligned": 0.9, "fp16": 0.96}),
              open(paths[2], "w"))
    readme_figure.main([*paths, "--out", out])
    drawn = json.load(open(out[:-4] + ".json"))
    avx2, amx = drawn["runs"].values()
    assert avx2["bf16"] == {"seeds": [0, 1], "heldout": [0.9, 0.1], "fell": 1} and amx["bf16-trunc"]["fell"] == 1
    assert drawn["mismatch"]["bf16"]["mean"] == [2e-4, 1e-4]
    assert "fell bf16 1 of 2, bf16-aligned 0 of 2" in capsys.readouterr().out
    json.dump(causal({"bf16": 0.1, "fp16": 0.96}), open(paths[1], "w"))  # no bf16-aligned
    with pytest.raises(SystemExit) as e:
        readme_figure.main([*paths, "--out", out])
    assert e.value.code == 2
    json.dump({"machine": "chip", "arms": {"grpo": arm}}, open(paths[0], "w"))
    with pytest.raises(SystemExit) as e:
        readme_figure.main([*paths, "--out", out])
    assert e.value.code == 2
