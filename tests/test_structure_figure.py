"""experiments/structure_figure.py: each structured shape against uniform noise at the same dose,
paired by seed, by hand on a folder of dial runs with hand-set outcomes."""
import json
import os

import pytest

import structure_figure

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
HELDOUT = {(0, None): [0.95, 0.96, 0.97], (10, "uniform"): [0.94, 0.95, 0.96],
           (10, "temperature"): [0.90, 0.93, 0.91]}
ROW = {"reward_mean": 0.9, "mismatch_logp_abs_mean": 4e-3, "pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3],
       "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0], "response_len_mean": 24.0,
       "entropy_mean": 0.1, "logit_rms": 3.0}


def structure_folder(root, heldout=HELDOUT):
    folder = os.path.join(root, "chip")
    for (dose, shape), accs in heldout.items():
        for seed, acc in enumerate(accs):
            run = os.path.join(folder, "gspo-engine-bf16-aligned" + (f"-dial{dose}-{shape}" if dose else "")
                               + f"-s{seed}")
            os.makedirs(run)
            args = {"dtype": "bf16", "trainer_kernels": "engine", "seed": seed, "steps": 2, "machine": MACHINE}
            if dose:
                args.update(dial_dose=dose, dial_shape=shape)
            for f, text in (("args.json", json.dumps(args)), ("heldout.json", json.dumps({"accuracy": acc})),
                            ("metrics.jsonl", "\n".join(json.dumps({**ROW, "step": s}) for s in (0, 1)))):
                open(os.path.join(run, f), "w").write(text + "\n")
    json.dump({"unit": 4e-4, "fp16": 2e-5}, open(os.path.join(folder, "dial.json"), "w"))
    return folder


def test_temperature_against_uniform_by_hand(tmp_path, capsys):
    out = str(tmp_path / "structure.png")
    structure_figure.main([structure_folder(str(tmp_path)), "--arms", "gspo-engine", "--out", out])
    result = json.load(open(out[:-4] + ".json"))
    (test,) = result["against_uniform"]  # persistent has no runs: no test
    diff = [a - b for a, b in zip(HELDOUT[(10, "temperature")], HELDOUT[(10, "uniform")])]
    assert (test["shape"], test["dose"]) == ("temperature", 10)
    assert test["mean"] == pytest.approx(sum(diff) / 3)
    assert test["p_sign_flip"] == pytest.approx(2 / 8) == test["p_holm"]  # all three below 0
    paired = result["shapes"]["temperature"]["arms"]["gspo-engine"]["heldout"]["paired"]["10"]
    assert paired["mean"] == pytest.approx(-0.14 / 3)  # against dose 0, the aligned run
    assert "| gspo-engine | temperature | 10x | 3 | -0.0367" in capsys.readouterr().out


def test_doses_keeps_those_doses_alone(tmp_path):
    """--doses: a dose some seeds have not run yet (here 1x) leaves the table, and the figure,
    while the named doses keep their cells and their pairs with dose 0."""
    heldout = {**HELDOUT, (1, "temperature"): [0.95, 0.95, 0.96]}
    folder, out = structure_folder(str(tmp_path), heldout), str(tmp_path / "structure.png")
    structure_figure.main([folder, "--arms", "gspo-engine", "--out", out])
    every = json.load(open(out[:-4] + ".json"))["shapes"]["temperature"]["arms"]["gspo-engine"]
    assert every["doses"] == [0, 1, 10]  # without --doses, every dose on disk
    structure_figure.main([folder, "--arms", "gspo-engine", "--doses", "0", "10", "--out", out])
    result = json.load(open(out[:-4] + ".json"))
    for shape in ("temperature", "uniform"):
        entry = result["shapes"][shape]["arms"]["gspo-engine"]
        assert entry["doses"] == [0, 10] and sorted(entry["cells"]) == ["0", "10"]
        assert sorted(entry["heldout"]["paired"]) == ["10"]
    assert [(t["shape"], t["dose"]) for t in result["against_uniform"]] == [("temperature", 10)]
