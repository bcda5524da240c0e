"""The mismatch dial (experiments/dial.py): nothing at dose 0, and above it the engine really samples
from the perturbed distribution whose log-probs it returns."""
import math

import pytest
import torch

import dial
import rollout
import task
from conftest import MAX_LEN, PROMPTS
from model import hf_named_tensors, load_hf, pack, token_logprobs
from precision import get_precision, mismatch_metrics


def test_dose_0_installs_nothing():
    assert dial.engine_args(0.0) == {} and dial.sigma_for({"unit": 1e-4, "grid": {}}, "uniform", 0) == 0.0
    dial.configure(0.0)
    logits = torch.randn(3, 7)
    assert dial.DialProcessor(None, "cpu", False).apply(logits) is logits


def test_bf16_shape_scales_each_entry_by_its_bucket_of_pi():
    probs = torch.tensor([[0.2, 0.5, 0.95, 0.995, 0.9995, 1.0]])
    scale = dial.bucket_scale(probs, [10.0, 5.0, 2.0, 1.0, 0.5])
    assert scale.tolist() == [[10.0, 5.0, 2.0, 1.0, 0.5, 0.5]]  # [0, .5), [.5, .9), ... [.999, 1]


def test_sigma_for_interpolates_the_calibration_in_log_log():
    cal = {"unit": 2e-4, "grid": {"uniform": [[1e-2, 1e-4], [1e-1, 1e-3]]}}
    # 3x the unit = 6e-4 per token: between the two grid points, a power law through both
    assert dial.sigma_for(cal, "uniform", 3) == pytest.approx(6e-2)
    with pytest.raises(ValueError, match="outside"):
        dial.sigma_for(cal, "uniform", 100)


@pytest.fixture(scope="module")
def dialed(random_ckpt):
    return rollout.start_engine(random_ckpt, "bfloat16", 0, MAX_LEN, **dial.engine_args(1.0))


@pytest.mark.parametrize("shape", ["uniform", "bf16"])
def test_the_engine_samples_from_the_distribution_it_reports(dialed, random_ckpt, shape):
    """The aligned trainer's pi is the engine's own unperturbed distribution. Tokens drawn from mu
    give E[log mu - log pi] = KL(mu || pi) > 0; had the engine drawn them from pi and only
    reported mu, the mean would be -KL(pi || mu) < 0. The sign tells which distribution sampled."""
    model = load_hf(random_ckpt)
    rollout.sync_weights(dialed, hf_named_tensors(model), torch.bfloat16)
    dial.configure(1.0, shape, [4.0, 2.0, 1.0, 0.5, 0.25])
    torch.manual_seed(0)
    samples = rollout.generate(dialed, PROMPTS, 8, 24, task.EOS_ID)
    dial.configure(0.0)
    idx, mask, mu = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], "cpu",
                         [s.logprobs for s in samples])
    with torch.no_grad():
        pi = token_logprobs(get_precision("bf16", device="cpu", kernels="engine").forward(model), idx)
    d = ((mu - pi) * mask)[mask.bool()].double()
    se = d.std().item() / math.sqrt(d.numel())
    m = mismatch_metrics(mu, pi, mask)
    assert m["mismatch_logp_abs_mean"] > 0.05  # the dial is on
    assert m["mismatch_k1"] > 4 * se, (m["mismatch_k1"], se)  # drawn from mu


HELDOUT = {  # held-out accuracy by dose and seed: dose 1 loses nothing, dose 10 about 0.025
    0: [0.95, 0.96, 0.97],
    1: [0.949, 0.961, 0.97],
    10: [0.93, 0.93, 0.945],
}


def dial_folder(root):
    """A results folder of dial runs as campaign.py leaves them, with hand-set outcomes."""
    import json
    import os

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
    import json
    import os

    from experiments import plot

    out = os.path.join(tmp_path, "dial.png")
    plot.main(["dial", dial_folder(str(tmp_path)), "--out", out])
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
    import json
    import os

    from experiments import plot

    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    plot.main(["dial", folder, "--seeds", "0", "2", "--out", out])
    arm = json.load(open(out[:-4] + ".json"))["shapes"]["uniform"]["arms"]["grpo"]
    assert arm["cells"]["10"]["seeds"] == [0, 2]
    d10 = [HELDOUT[10][s] - HELDOUT[0][s] for s in (0, 2)]  # -0.02, -0.025
    assert arm["heldout"]["paired"]["10"]["mean"] == pytest.approx(sum(d10) / 2)
    with pytest.raises(SystemExit) as stop:
        plot.main(["dial", folder, "--seeds", "7", "--out", out])
    assert stop.value.code == 2


def test_tail_counts_the_runs_below_a_level_seed_by_seed(tmp_path, capsys):
    """--tail L: per cell the seeds whose held-out accuracy ends below L (hand-set: at 0.94, dose
    10's seeds 0 and 1, no run of doses 0 and 1), printed and in the JSON; other figures refuse it."""
    import json
    import os

    from experiments import plot

    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    plot.main(["dial", folder, "--tail", "0.94", "--out", out])
    tail = json.load(open(out[:-4] + ".json"))["tail"]
    below = {c["dose"]: c["seeds_below"] for c in tail["cells"] if c["arm"] == "grpo"}
    assert tail["level"] == 0.94 and below == {0: [], 1: [], 10: [0, 1]}
    assert "| uniform | grpo | 10x | 3 | 2 | s0 0.9300*, s1 0.9300*, s2 0.9450 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        plot.main(["experiment", folder, "--tail", "0.9", "--out", out])
    assert stop.value.code == 2


def test_arms_draws_those_arms_alone_and_refuses_one_with_no_run(tmp_path):
    """--arms grpo: the folder's one arm, the same JSON as without it; an arm with no run: one line, exit 2."""
    import json
    import os

    from experiments import plot

    folder, out = dial_folder(str(tmp_path)), os.path.join(tmp_path, "dial.png")
    plot.main(["dial", folder, "--out", out])
    every = json.load(open(out[:-4] + ".json"))
    plot.main(["dial", folder, "--arms", "grpo", "--out", out])
    assert json.load(open(out[:-4] + ".json")) == every and list(every["shapes"]["uniform"]["arms"]) == ["grpo"]
    with pytest.raises(SystemExit) as stop:
        plot.main(["dial", folder, "--arms", "grpo", "gspo-engine", "--out", out])
    assert stop.value.code == 2


def test_the_dial_plan_runs_every_cell_once_top_dose_first():
    """3 arms x 5 seeds x (dose 0 + 2 shapes x 5 doses), each once; the top dose pairs with 0 first."""
    import argparse

    import campaign

    runs = campaign.plan_runs(argparse.Namespace(plan="dial", seeds=[0, 1, 2, 3, 4], arms=None))
    names = [name for name, _, _ in runs]
    assert len(names) == len(set(names)) == 3 * 5 * (1 + 2 * 5)
    assert names[:3] == ["grpo-bf16-aligned-s0", "grpo-bf16-aligned-dial100-uniform-s0", "grpo-bf16-aligned-s1"]
    assert dict((n, d) for n, _, d in runs)["gspo-engine-bf16-aligned-dial3-bf16-s4"] == [
        "--dial", "3", "--dial-shape", "bf16"]
    # --arms keeps one arm's runs, in the plan's order; an arm not in the plan is refused
    gspo = campaign.plan_runs(argparse.Namespace(plan="dial", seeds=[0, 1], arms=["gspo-engine"]))
    assert [n for n, _, _ in gspo] == [n for n in names if n.startswith("gspo-engine-") and n[-1] in "01"]
    with pytest.raises(SystemExit) as refused:
        campaign.main(["--plan", "dial", "--arms", "gspo", "--list"])
    assert refused.value.code == 2


def test_the_length_plan_pairs_longer_responses_with_their_own_dose_0():
    """2 arms x 5 seeds x (dose 0, 100x, 10x) at 20 items; read by held-out alone, on 20-item problems."""
    import argparse

    import campaign

    runs = campaign.plan_runs(argparse.Namespace(plan="dial-length", seeds=[0, 1, 2, 3, 4], arms=None))
    names = [name for name, _, _ in runs]
    assert len(names) == len(set(names)) == 2 * 5 * 3
    assert names[:2] == ["grpo-len20-bf16-aligned-s0", "grpo-len20-bf16-aligned-dial100-uniform-s0"]
    flags = dict((n, f) for n, f, _ in runs)["gspo-engine-len20-bf16-aligned-dial10-uniform-s3"]
    assert flags[flags.index("--n-items") + 1] == "20" and flags[flags.index("--seed") + 1] == "3"
    assert flags[flags.index("--algorithm") + 1] == "gspo"
    assert not campaign.probed("gspo-engine-len20-bf16-aligned-s0")
    assert campaign.probed("gspo-engine-bf16-aligned-s0")  # the dial's dose 0 is section 1's run
    heldout = campaign.heldout_command("runs/x", flags, 8)  # a 20-item policy on 20-item problems
    assert heldout[heldout.index("--n-items") + 1] == "20" and heldout[heldout.index("--seed") + 1] == "3"
    assert "--n-items" not in campaign.heldout_command("runs/x", ["--seed", "0"], 8)


def test_the_patches_plan_pairs_each_fix_with_its_own_dose_0():
    """gspo's ablation and 3 patches x 5 seeds x (dose 0, 100x, 10x), uniform; gspo and token-tis keep
    the trainer's pi_old."""
    import argparse

    import campaign

    runs = campaign.plan_runs(argparse.Namespace(plan="dial-patches", seeds=[0, 1, 2, 3, 4], arms=None))
    names = [name for name, _, _ in runs]
    assert len(names) == len(set(names)) == 4 * 5 * 3
    assert names[:2] == ["gspo-bf16-aligned-s0", "gspo-bf16-aligned-dial100-uniform-s0"]
    flags = dict((n, f) for n, f, _ in runs)
    tis = flags["token-tis-bf16-aligned-dial10-uniform-s2"]
    assert tis[tis.index("--algorithm") + 1] == "token-tis" and "--behavior-logp" not in tis
    mis = flags["seq-mis-engine-bf16-aligned-dial100-uniform-s4"]
    assert mis[mis.index("--behavior-logp") + 1] == "engine"
    assert {n.split("-bf16")[0] for n in names} == {"gspo", "token-tis", "seq-mis-engine", "pg-seq-is"}
    assert "--behavior-logp" not in flags["gspo-bf16-aligned-dial100-uniform-s0"]
    assert all(d == [] or d[:2] in (["--dial", "100"], ["--dial", "10"]) for _, _, d in runs)
    import train_grpo  # every run's flags pass the trainer's own checks (token-tis with mu refused)

    assert all(train_grpo.get_args(f).algorithm in {"gspo", "token-tis", "seq-mis", "pg-seq-is"} for f in flags.values())


def test_the_tail_plan_pairs_new_seeds_at_dose_0_and_10x_bf16_shaped():
    """The paper's recipe at dose 0 and 10x of the bf16 shape, each new seed's pair in turn."""
    import argparse

    import campaign

    runs = campaign.plan_runs(argparse.Namespace(plan="dial-tail", seeds=list(range(5, 15)), arms=None))
    names = [name for name, _, _ in runs]
    assert len(names) == len(set(names)) == 10 * 2
    assert names[:2] == ["drgrpo-mb4-bf16-aligned-s5", "drgrpo-mb4-bf16-aligned-dial10-bf16-s5"]
    assert [d for _, _, d in runs][:2] == [[], ["--dial", "10", "--dial-shape", "bf16"]]
    flags = dict((n, f) for n, f, _ in runs)["drgrpo-mb4-bf16-aligned-dial10-bf16-s14"]
    assert "--dr-grpo" in flags and flags[flags.index("--minibatches") + 1] == "4"
    assert flags[flags.index("--seed") + 1] == "14"
