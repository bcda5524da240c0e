"""experiments/dial_figure.py: the practitioner's table by hand on a folder of dial runs with
hand-set outcomes; --seeds, --tail, --arms."""
import json
import os
import shutil

import pytest

import campaign_figure
import dial_figure


HELDOUT = {  # held-out accuracy by dose and seed: dose 1 loses nothing, dose 10 about 0.025
    0: [0.95, 0.96, 0.97],
    1: [0.949, 0.961, 0.97],
    10: [0.93, 0.93, 0.945],
}


def dial_folder(root):
    """A results folder of dial runs as campaign.py leaves them, with hand-set outcomes."""
    folder = os.path.join(root, "results", "chip")
    os.makedirs(folder)
    row = {"reward_mean": 0.9, "mismatch_logp_abs_mean": 1e-4, "pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3],
           "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0], "response_len_mean": 24.0,
           "entropy_mean": 0.1, "logit_rms": 3.0}
    machine = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
    for dose, accs in HELDOUT.items():
        for seed, acc in enumerate(accs):
            name = "grpo-bf16-aligned" + (f"-dial{dose}-uniform" if dose else "") + f"-s{seed}"
            os.makedirs(os.path.join(folder, name))
            args = {"dtype": "bf16", "trainer_kernels": "engine", "seed": seed, "steps": 2, "machine": machine}
            if dose:
                args.update(dial_dose=dose, dial_shape="uniform")
            for f, text in (("args.json", json.dumps(args)), ("heldout.json", json.dumps({"accuracy": acc})),
                            ("metrics.jsonl", "\n".join(json.dumps({**row, "step": s}) for s in (0, 1)))):
                open(os.path.join(folder, name, f), "w").write(text + "\n")
    json.dump({"unit": 4e-4, "fp16": 2e-5}, open(os.path.join(folder, "dial.json"), "w"))
    return folder


def test_practitioners_table_by_hand(tmp_path, capsys):
    """The paired differences against dose 0, the largest dose with no measurable loss, and the
    dose at a loss of 0.01, log-linear between the doses, all as computed by hand."""
    out = os.path.join(tmp_path, "dial.png")
    dial_figure.main([dial_folder(str(tmp_path)), "--out", out])
    arm = json.load(open(out[:-4] + ".json"))["shapes"]["uniform"]["arms"]["grpo"]["heldout"]
    d10 = [a - b for a, b in zip(HELDOUT[10], HELDOUT[0])]  # -0.02, -0.03, -0.025
    assert arm["paired"]["10"]["mean"] == pytest.approx(sum(d10) / 3)
    assert arm["paired"]["10"]["ci95"][1] < 0 < arm["paired"]["1"]["ci95"][1]
    assert arm["largest_dose_no_loss"] == 1  # dose 10's interval lies below 0
    # the mean falls from 0 (dose 1) to -0.025 (dose 10): -0.01 at 0.4 of the way, in log dose
    assert arm["dose_at_loss_0.01"]["estimate"] == pytest.approx(10**0.4)
    assert arm["dose_at_loss_0.05"]["estimate"] is None  # not reached
    assert "| uniform | grpo | 3 | 1, 10x | 1x | 2.51x" in capsys.readouterr().out


def test_seeds_reads_those_seeds_runs_alone(tmp_path):
    """--seeds: the cells and their pairs hold the named seeds only (the tail's new seeds are read
    apart from the plan's); a seed with no run is refused in one line."""
    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    dial_figure.main([folder, "--seeds", "0", "2", "--out", out])
    arm = json.load(open(out[:-4] + ".json"))["shapes"]["uniform"]["arms"]["grpo"]
    assert arm["cells"]["10"]["seeds"] == [0, 2]
    d10 = [HELDOUT[10][s] - HELDOUT[0][s] for s in (0, 2)]  # -0.02, -0.025
    assert arm["heldout"]["paired"]["10"]["mean"] == pytest.approx(sum(d10) / 2)
    with pytest.raises(SystemExit) as stop:
        dial_figure.main([folder, "--seeds", "7", "--out", out])
    assert stop.value.code == 2


def test_tail_counts_the_runs_below_a_level_seed_by_seed(tmp_path, capsys):
    """--tail L: per cell the seeds whose held-out accuracy ends below L (hand-set: at 0.94, dose
    10's seeds 0 and 1, no run of doses 0 and 1), printed and in the JSON; other figures refuse it."""
    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    dial_figure.main([folder, "--tail", "0.94", "--out", out])
    tail = json.load(open(out[:-4] + ".json"))["tail"]
    below = {c["dose"]: c["seeds_below"] for c in tail["cells"] if c["arm"] == "grpo"}
    assert tail["level"] == 0.94 and below == {0: [], 1: [], 10: [0, 1]}
    assert "| uniform | grpo | 10x | 3 | 2 | s0 0.9300*, s1 0.9300*, s2 0.9450 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        campaign_figure.main([folder, "--tail", "0.9", "--out", out])
    assert stop.value.code == 2


def test_arms_draws_those_arms_alone_and_refuses_one_with_no_run(tmp_path):
    """--arms grpo: the folder's one arm, the same JSON as without it; an arm with no run: one line, exit 2."""
    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    dial_figure.main([folder, "--out", out])
    every = json.load(open(out[:-4] + ".json"))
    dial_figure.main([folder, "--arms", "grpo", "--out", out])
    assert json.load(open(out[:-4] + ".json")) == every and list(every["shapes"]["uniform"]["arms"]) == ["grpo"]
    with pytest.raises(SystemExit) as stop:
        dial_figure.main([folder, "--arms", "grpo", "gspo-engine", "--out", out])
    assert stop.value.code == 2


def test_chip_marks_take_the_calibration_first_and_shapes_hold_the_figure(tmp_path, monkeypatch):
    """A chip's bf16 and fp16 marks: its dial.json where it has one, whatever runs land beside it
    (a figure does not move as runs land); the mean of its campaign runs' step 0 where it has none
    (the larger GPT's arm and seeds past 7 not counted); a folder CHIPS does not name, none.
    --shapes keeps the named shapes alone."""
    monkeypatch.setattr(dial_figure, "CHIPS", {"chip": "chip", "other": "other"})
    folder = dial_folder(str(tmp_path))
    other, unnamed = (os.path.join(os.path.dirname(folder), g) for g in ("other", "unnamed"))
    machine = {"cpu": "other", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
    runs = ((folder, "gspo-engine", 0, 9e-4), (other, "gspo-engine", 0, 3e-4),
            (unnamed, "gspo-engine", 0, 1e-4),  # a chip not named: no mark
            (other, "gspo-engine-x8", 0, 8e-4), (other, "gspo-engine", 8, 8e-4))  # not counted
    for chip, arm, seed, mismatch in runs:  # plain bf16 and fp16 runs
        for dtype in ("bf16", "fp16"):
            run = os.path.join(chip, f"{arm}-{dtype}-s{seed}")
            os.makedirs(run)
            json.dump({"dtype": dtype, "seed": seed, "steps": 1, "machine": machine},
                      open(os.path.join(run, "args.json"), "w"))
            open(os.path.join(run, "metrics.jsonl"), "w").write(
                json.dumps({"mismatch_logp_abs_mean": mismatch}) + "\n")
    marks = dial_figure.chip_marks(os.path.dirname(folder))
    assert marks["chip"]["bf16"] == {"n": "dial.json", "mean": 4e-4}  # not its run's 9e-4
    assert marks["other"]["bf16"] == {"n": 1, "mean": 3e-4}
    assert set(marks) == {"chip", "other"}
    for seed in range(3):  # a second shape's runs beside uniform's
        name = os.path.join(folder, f"grpo-bf16-aligned-dial10-temperature-s{seed}")
        shutil.copytree(os.path.join(folder, f"grpo-bf16-aligned-dial10-uniform-s{seed}"), name)
        args = json.load(open(os.path.join(name, "args.json")))
        json.dump({**args, "dial_shape": "temperature"}, open(os.path.join(name, "args.json"), "w"))
    out = os.path.join(tmp_path, "dial.png")
    dial_figure.main([folder, "--arms", "grpo", "--out", out])
    assert set(json.load(open(out[:-4] + ".json"))["shapes"]) == {"uniform", "temperature"}
    dial_figure.main([folder, "--arms", "grpo", "--shapes", "uniform", "--out", out])
    assert set(json.load(open(out[:-4] + ".json"))["shapes"]) == {"uniform"}
    with pytest.raises(SystemExit) as e:  # no run of that shape: one line, exit 2
        dial_figure.main([folder, "--arms", "grpo", "--shapes", "bf16", "--out", out])
    assert e.value.code == 2
