"""experiments/campaign.py and plans.py: the runner in fresh processes (once, skipped when done,
resumed), a dirty tree refused or its diff kept, a CPU new to its folder refused, and the plans'
runs well formed."""
import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

import campaign
import plans
import results
import train_grpo
import variants
import warm_start
from conftest import ROOT, tiny_args
from instruments import machine
from variants import LATE_SWAP, SWAP_STEP, VARIANTS, parse_run, variant_of


def test_campaign_runs_once_skips_what_is_done_and_resumes(warm_dir, tmp_path):
    """The runner in fresh processes on a one-run plan: the run's small files land in
    results/<machine>/NAME; run again, nothing runs; with its results gone but its checkpoint there,
    it is resumed (no step redone) and its files come back identical."""
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
    cmd = [sys.executable, "experiments/campaign.py", "--plan", "smoke", "--seeds", "0", "--samples", "1",
           "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--allow-dirty",
           "--", "--steps", "2", "--batch-size", "4", "--group-size", "4", "--init", init]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    kept = tmp_path / "results" / campaign.machine_group(machine()) / "grpo-fp32-s0"
    files = ["args.json", "heldout.json", "metrics.jsonl"] + ["diff.patch"] * bool(campaign.tree_diff())
    assert "1 runs, 0 done" in first and sorted(os.listdir(kept)) == sorted(files)  # dirty: its diff
    metrics = (kept / "metrics.jsonl").read_text()
    assert [json.loads(r)["step"] for r in metrics.splitlines()] == [0, 1]
    # The record tells two CPU generations apart where a VM masks the model name (x86 Linux).
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert json.loads((kept / "args.json").read_text())["commit"] == head.strip()  # what computed it
    recorded = json.loads((kept / "args.json").read_text())["machine"]
    if os.path.isfile("/proc/cpuinfo") and "cpu family" in open("/proc/cpuinfo").read():
        assert [part.isdigit() for part in recorded["cpu_id"].split("/")] == [True] * 3, recorded
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "1 runs, 1 done" in again and "[1/1]" not in again
    for f in os.listdir(kept):
        os.remove(kept / f)
    os.rmdir(kept)
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "resuming" in resumed and (kept / "metrics.jsonl").read_text() == metrics
    subprocess.run(cmd[:2] + ["--stop-after", "1"] + cmd[2:], cwd=ROOT, capture_output=True, text=True, check=True)
    stopped = kept.parent / "step1" / "grpo-fp32-s0"  # the same run ended after its first update, read
    assert json.loads((stopped / "args.json").read_text())["stop_after"] == 1 and (stopped / "heldout.json").is_file()
    def same(row):
        return {k: v for k, v in json.loads(row).items() if not k.startswith("time_") and "per_s" not in k}
    assert [same(r) for r in (stopped / "metrics.jsonl").read_text().splitlines()] == [same(metrics.splitlines()[0])]
    later = subprocess.run(cmd[:2] + ["--stop-after", "2"] + cmd[2:], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout  # goes on from step 1's checkpoint, equal to the whole run
    rows = (kept.parent / "step2" / "grpo-fp32-s0" / "metrics.jsonl").read_text().splitlines()
    assert "resuming" in later and [same(r) for r in rows] == [same(r) for r in metrics.splitlines()]
    shutil.rmtree(kept)
    shutil.rmtree(tmp_path / "runs" / "grpo-fp32-s0")  # the whole run again: from step 2's stop
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = (kept / "metrics.jsonl").read_text().splitlines()
    assert "resuming" in again and [same(r) for r in rows] == [same(r) for r in metrics.splitlines()]


def first_updates(warm_dir, tmp_path, variants):
    """Each variant's first update on seed 0's small warm start, through campaign.py --run
    --variant in a process of its own (one kernel library, one compilation config a process): variant ->
    (its first metrics row, its args.json)."""
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
    first = {}
    for variant in variants:
        out = tmp_path / variant
        subprocess.run([sys.executable, "experiments/campaign.py", "--run", "--stop-after", "1",
                        "--variant", variant, "--", *VARIANTS[variant].flags, "--init", init,
                        "--batch-size", "16", "--group-size", "8", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, check=True)
        first[variant] = (json.loads((out / "metrics.jsonl").read_text().splitlines()[0]),
                          json.loads((out / "args.json").read_text()))
    return first


def test_the_rotary_on_torch_variant_runs_an_engine_closer_to_the_trainer(warm_dir, tmp_path):
    """bf16-rotary-torch's engine leaves a smaller first-update mismatch than bf16's on the same
    warm start where vLLM's rotary kernel truncates (rounding.md; on the AMD EPYC with AVX2 11 %
    less on this small warm start, 43 % at seed 0's full size); where it rounds, a different one."""
    first = first_updates(warm_dir, tmp_path, ("bf16", "bf16-rotary-torch"))
    for variant, (_, args) in first.items():
        custom = args.get("engine_custom_ops")
        assert custom == (["-rotary_embedding"] if "rotary" in variant else None)
    bf16, torch_rotary = (first[v][0]["mismatch_logp_abs_mean"] for v in ("bf16", "bf16-rotary-torch"))
    if "avx512_bf16" in machine()["cpu_isa"]:
        assert torch_rotary != bf16
    else:
        assert torch_rotary < bf16, (torch_rotary, bf16)


def test_the_trunc_variant_runs_the_truncating_library_farther_from_the_trainer(warm_dir, tmp_path):
    """bf16-trunc (its record's library: _C_AVX512) runs where the chip's own library
    rounds: the engine on the truncating kernels, AMX hidden (its kernels live in _C only),
    recorded in args.json, a larger first-update mismatch than bf16's (rounding.md). On AMX,
    the control bf16-noamx (AMX hidden: _C's vector kernels, which round) is recorded as such,
    and truncation's mismatch is larger than it too: the kernels' rounding, not AMX's absence."""
    isa = machine()["cpu_isa"]
    if "avx512_bf16" not in isa:
        pytest.skip("the chip's own library truncates: plan rounding has no -trunc runs here")
    control = ("bf16-noamx",) * ("amx_tile" in isa)
    first = first_updates(warm_dir, tmp_path, ("bf16", "bf16-trunc", *control))
    library = {"bf16": None, "bf16-trunc": "_C_AVX512", "bf16-noamx": "_C"}
    for variant, (_, args) in first.items():
        assert args.get("kernel_library") == library[variant]
        assert args.get("amx_hidden", False) == (variant == "bf16-noamx")
    mismatch = {v: row["mismatch_logp_abs_mean"] for v, (row, _) in first.items()}
    assert len(set(mismatch.values())) == len(mismatch), mismatch  # each its own kernels
    assert mismatch["bf16-trunc"] == max(mismatch.values()), mismatch


def test_a_dirty_tree_is_refused_and_allow_dirty_keeps_the_diff(tmp_path, monkeypatch, capsys):
    """Uncommitted changes to tracked files: refused in one line before any run; with --allow-dirty
    each run's results hold the diff beside its files (a result names the code that made it)."""
    monkeypatch.setattr(campaign, "tree_diff", lambda: "diff --git a/grpo.py b/grpo.py\n")
    argv = ["--plan", "smoke", "--seeds", "0", "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results")]
    with pytest.raises(SystemExit) as e:
        campaign.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--allow-dirty" in err, err
    assert not (tmp_path / "results").exists()
    run = tmp_path / "runs" / "grpo-fp32-s0"  # a finished run's files, as train and heldout leave them
    run.mkdir(parents=True)
    for f in ("args.json", "metrics.jsonl", "heldout.json"):
        (run / f).write_text("{}\n")
    monkeypatch.setattr(campaign, "commands", lambda *a: [])  # nothing to train or read
    campaign.main(argv + ["--allow-dirty"])
    kept = tmp_path / "results" / campaign.machine_group(machine()) / "grpo-fp32-s0"
    assert (kept / "diff.patch").read_text() == "diff --git a/grpo.py b/grpo.py\n"


def test_a_cpu_new_to_its_folder_is_refused_until_its_reruns_are_in(tmp_path, monkeypatch, capsys):
    """A machine folder holding runs of another family/model/stepping only: refused in one line
    before any run, nothing written; runs from before cpu_id was recorded say nothing; once this
    CPU's seed-0 reruns are moved in (ID-reruns/), its runs go on."""
    group = tmp_path / "results" / campaign.machine_group(machine())
    def hand_run(path, cpu_id):  # a run's args.json as train_run records it, another cpu_id
        path.mkdir(parents=True)
        recorded = {k: v for k, v in machine().items() if k != "cpu_id"}
        recorded |= {"cpu_id": cpu_id} if cpu_id else {}  # None: recorded before cpu_id was
        (path / "args.json").write_text(json.dumps({"machine": recorded}))
    ran = []
    monkeypatch.setattr(campaign, "tree_diff", lambda: "")
    monkeypatch.setattr(campaign, "run_all", lambda *a: ran.append(a))
    argv = ["--plan", "smoke", "--seeds", "0", "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results")]
    hand_run(group / "grpo-fp32-s1", None)
    campaign.main(argv)
    assert len(ran) == 1  # no cpu_id recorded in the folder: nothing to compare with
    hand_run(group / "grpo-fp32-s2", "0/0/0")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        campaign.main(argv)
    err = capsys.readouterr().err.strip()
    mine = machine()["cpu_id"]
    assert e.value.code == 2 and len(err.splitlines()) == 1 and mine in err and "0/0/0" in err, err
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert len(ran) == 1 and after == before
    hand_run(group / f"{mine.replace('/', '-')}-reruns" / "grpo-fp32-s0", mine)
    campaign.main(argv)
    assert len(ran) == 2


def recorded_options(v):
    """What campaign.train_run writes into args.json for a variant's engine options (the
    library as rounding.load reports it on a chip that runs the variant)."""
    dial, swap = v.dial or (None, None), v.swap or (None, None)
    return {"kernel_library": v.library or ("_C" if v.hide_amx else None), "amx_hidden": v.hide_amx,
            "engine_custom_ops": ["-rotary_embedding"] if v.rotary_torch else None,
            "dial_dose": dial[0], "dial_shape": dial[1], "swap_from": swap[0], "swap_step": swap[1],
            **({"site_rounding": v.site_rounding} if v.site_rounding != "rne" else {}),
            **({"embed_grad": v.embed_grad} if v.embed_grad != "dtype" else {}),
            **({"attention_weights": v.attention_weights}
               if v.attention_weights != "float32" else {})}


@pytest.mark.parametrize("plan", list(plans.PLANS))
def test_every_plan_names_each_run_once_and_the_trainer_takes_its_flags(plan, tmp_path):
    """Each (arm, variant, seed) once; every run's flags pass train_grpo's own checks (a refused
    combination, such as token-tis with the engine's pi_old, would stop the campaign mid-plan);
    every dosed run has its dose 0 (the same arm's aligned run, same seed) in the same plan."""
    runs = plans.plan_runs(plan, [0, 1])
    names = [name for name, _, _ in runs]
    assert len(names) == len(set(names)) > 0
    for name, flags, variant in runs:
        args = train_grpo.get_args([*flags, "--out", str(tmp_path / name)])
        arm, parsed, seed = parse_run(name)
        assert args.seed == seed and parsed is variant
        assert variant_of({**vars(args), **recorded_options(variant)}) is variant
        if variant.dial:
            assert f"{arm}-bf16-aligned-s{seed}" in names, (plan, name)


def test_the_commands_read_a_run_at_its_own_length_and_probe_only_the_campaigns_arms(tmp_path):
    """A 20-item run's held-out reading uses 20-item problems and its seed; a 12-item run's the
    default; the cross-probe reads gspo-engine's campaign runs, not its dial or length runs."""
    args = argparse.Namespace(runs=str(tmp_path), stop_after=None, extra=[], samples=8)
    runs = dict((n, f) for n, f, _ in plans.plan_runs("dial-length", [3]))
    name = "gspo-engine-len20-bf16-aligned-dial10-uniform-s3"
    steps = campaign.commands(name, runs[name], VARIANTS["bf16-aligned-dial10-uniform"], args,
                              str(tmp_path))
    heldout = next(s for s in steps if "experiments/heldout.py" in s)
    assert heldout[heldout.index("--n-items") + 1] == "20" and heldout[heldout.index("--seed") + 1] == "3"
    plain = campaign.commands("grpo-bf16-s0", ["--seed", "0"], VARIANTS["bf16"], args, str(tmp_path))
    assert "--n-items" not in next(s for s in plain if "experiments/heldout.py" in s)
    assert not plans.probed("gspo-engine-len20-bf16-aligned-s0") and plans.probed("gspo-engine-bf16-s0")
    assert not plans.probed("gspo-engine-bf16-aligned-dial10-uniform-s0")

def test_a_run_killed_before_its_first_checkpoint_goes_on_from_the_kept_stop(tmp_path):
    """A run folder with its args.json only (killed before its first checkpoint) is no reason
    to start from step 0: the earlier stop's checkpoint is copied in and resumed."""
    name, runs = "grpo-fp32-s0", tmp_path / "runs"
    stop = runs / "step2" / name
    (stop / "hf").mkdir(parents=True)
    (stop / "args.json").write_text(json.dumps({"steps": 4, "stop_after": 2}))
    (stop / "metrics.jsonl").write_text("{}\n{}\n")
    (stop / "hf" / "config.json").write_text("{}")
    (stop / "checkpoint.pt").write_bytes(b"step 2")
    (runs / name).mkdir()
    (runs / name / "args.json").write_text("{}")  # killed here
    args = argparse.Namespace(runs=str(runs), stop_after=None, extra=[], samples=8)
    train = campaign.commands(name, ["--seed", "0"], VARIANTS["fp32"], args, str(tmp_path))[0]
    assert train[-1] == "--resume" and (runs / name / "checkpoint.pt").read_bytes() == b"step 2"
    assert not (runs / name / "args.json").exists()  # the stop's args are not its end's


def test_a_swap_goes_on_from_its_before_sides_stop_or_is_refused(tmp_path, capsys):
    """variants.SWAPS: a swap run copies in its before variant's stop at SWAP_STEP and resumes it
    with the after variant's kernels, recording where it came from; with no such stop the
    plan is refused in one line before any run."""
    runs = tmp_path / "runs"
    args = argparse.Namespace(runs=str(runs), stop_after=None, extra=[], samples=8)
    (name, flags, opts), = [r for r in plans.plan_runs("swap", [3]) if "trunc-to-noamx" in r[0]]
    with pytest.raises(SystemExit) as e:
        campaign.refuse_unswappable([(name, flags, opts)], args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "swap-stops --variants bf16-trunc " in err, err
    stop = runs / f"step{SWAP_STEP}" / "gspo-engine-bf16-trunc-s3"
    (stop / "hf").mkdir(parents=True)
    (stop / "args.json").write_text(json.dumps({"steps": 40, "stop_after": SWAP_STEP}))
    (stop / "metrics.jsonl").write_text("{}\n" * SWAP_STEP)
    (stop / "hf" / "config.json").write_text("{}")
    (stop / "checkpoint.pt").write_bytes(b"step 10")
    campaign.refuse_unswappable([(name, flags, opts)], args)  # now there is one
    train = campaign.commands(name, flags, opts, args, str(tmp_path))[0]
    assert train[-1] == "--resume" and (runs / name / "checkpoint.pt").read_bytes() == b"step 10"
    assert train[train.index("--variant") + 1] == "bf16-trunc-to-noamx"
    assert VARIANTS["bf16-trunc-to-noamx"].swap == ("bf16-trunc", SWAP_STEP)
    (late, *_), = [r for r in plans.plan_runs("swap-late", [3]) if "trunc-to-noamx" in r[0]]
    with pytest.raises(SystemExit):  # a later swap needs its own stop, not SWAP_STEP's
        campaign.refuse_unswappable([(late, flags, opts)], args)
    assert f"--stop-after {LATE_SWAP} " in capsys.readouterr().err


def test_a_swapped_run_repeats_its_stop_then_reads_the_other_librarys_mismatch(warm_dir, tmp_path, monkeypatch):
    """A truncating run stopped after one update, then resumed twice: on the truncating
    library (its twin) and, as a swap, on the rounding one. The swap's first row is the stop's;
    its next update runs the rounding engine, closer to the trainer than its twin's (the same
    policy); args.json records the swap, and results.py names it before-to-after."""
    if not {"avx512_bf16", "amx_tile"} <= set(machine()["cpu_isa"]):
        pytest.skip("the swap needs both libraries and AMX to hide: variants.SWAPS runs on AMX")
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
    def run(out, opts, *more):
        subprocess.run([sys.executable, "experiments/campaign.py", "--run", *opts, "--", "--dtype", "bf16",
                        "--init", init, "--steps", "2", "--batch-size", "16", "--group-size", "8",
                        "--out", str(out), *more], cwd=ROOT, capture_output=True, text=True, check=True)
        return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    stop = run(tmp_path / "twin", ["--stop-after", "1", "--variant", "bf16-trunc"])
    shutil.copytree(tmp_path / "twin", tmp_path / "swap", ignore=shutil.ignore_patterns("hf", "*.json"))
    swap = run(tmp_path / "swap", ["--variant", "bf16-trunc-to-noamx"], "--resume")
    twin = run(tmp_path / "twin", ["--variant", "bf16-trunc"], "--resume")
    same = [{k: v for k, v in r.items() if not k.startswith("time_") and "per_s" not in k} for r in (stop[0], swap[0])]
    assert same[0] == same[1] and len(swap) == len(twin) == 2
    recorded = json.loads((tmp_path / "swap" / "args.json").read_text())
    assert (recorded["swap_from"], recorded["swap_step"], recorded["kernel_library"]) == ("bf16-trunc", 1, "_C")
    at1 = variants.Variant("bf16-trunc-to-noamx-at1", ("--dtype", "bf16"), hide_amx=True,
                           swap=("bf16-trunc", 1))
    monkeypatch.setattr(variants, "VARIANTS", {})
    variants.add(at1)  # a swap after 1 update is no plan's: named by its own record
    assert results.variant(recorded) == "bf16-trunc-to-noamx-at1"
    assert swap[1]["mismatch_logp_abs_mean"] < twin[1]["mismatch_logp_abs_mean"], (swap[1], twin[1])


def test_the_site_rounding_variants_move_the_mismatch_as_their_side_says(warm_dir, tmp_path):
    """sites.py through campaign.py --run --variant (one mode a process), recorded in args.json.
    Where the engine rounds (AMX hidden): the trainer truncating at the two sites leaves a larger
    first-update mismatch than the trainer rounding (bf16-noamx). Where the engine truncates (the
    chip's own library, or the truncating one forced on a rounding chip without AMX): the trainer
    truncating like it leaves a smaller one than the rounding trainer's (bf16-site-trunc also
    runs where the chip's own library rounds without AMX: that pair comes last)."""
    isa = machine()["cpu_isa"]
    rounding_engine = ("bf16-noamx", "bf16-noamx-site-trunc")  # first: where AMX hides
    pairs = (rounding_engine, ("bf16-trunc", "bf16-trunc-site-trunc"), ("bf16", "bf16-site-trunc"))
    pair = next(p for p in pairs if all(variants.runs_on(VARIANTS[v], isa) for v in p))
    first = first_updates(warm_dir, tmp_path, pair)
    assert first[pair[1]][1]["site_rounding"] == "trunc" and "site_rounding" not in first[pair[0]][1]
    plain, site = (first[v][0]["mismatch_logp_abs_mean"] for v in pair)
    assert (site > plain) if pair == rounding_engine else (site < plain), (plain, site)
