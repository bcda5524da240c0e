"""
experiments/campaign.py: every RL run of a plan (plans.py), each (arm, variant, seed) once,
resumable: stop it at any moment, run the same command again, and it goes on where it stopped.

    nohup python experiments/campaign.py > runs/campaign.log 2>&1 &   # the plan, in priority order
    python experiments/campaign.py --list                              # what is done, what is left
    python experiments/campaign.py --plan extend --seeds 5 6 7         # more seeds of a plan
    python experiments/campaign.py --plan midrun --stop-after 8        # arm 1 after 8 of 40 steps

A run is `train_grpo.py --seed S` with its arm's and variant's flags, in
runs/campaign/ARM-VARIANT-sS (--seed picks the warm start too: one per seed, cached); a run left
half done is resumed. A finished run's policy is read by one fp32 engine (heldout.py; in
PROBED arms also by mismatch.py --quick, and each seed's warm start once), then its small files
go to results/<machine>/: committed, skipped next time, what the figures are drawn from.
<machine> is the CPU model and the ISA features vLLM's kernels read: runs are paired only
within one machine's folder. --stop-after N ends every run after its N-th update (of its own
schedule: its rows equal the whole run's) and reads that policy; results/<machine>/stepN/
keeps them; a later stop, or the whole run, goes on from an earlier
stop's checkpoint where it is kept (resume is exact). A variant's
engine options (plans.run_options) reach --run: the dial's dose,
--library (vLLM's kernels from that library, rounding.py),
--rotary-torch (the rotary embedding on torch's path),
--hide-amx (the chip's own library without its AMX kernels),
--swap-from (plans.SWAPS: the run goes on from that variant's stop).
A campaign refuses a tree with uncommitted changes to tracked files,
unless --allow-dirty, which keeps the diff beside each run
(diff.patch): a result names its code.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

from common import ROOT, load, parser, refuse
from instruments import machine
from plans import BEFORE, DIAL_SHAPES, PLANS, SWAPS, plan_runs, probed
from rounding import LIBRARIES, refuse_unrunnable

def machine_group(m):
    """results/ subfolder name: the CPU (or GPU) model and the ISA features, as a slug."""
    name = f"{m['gpu'] or m['cpu']} {' '.join(m['cpu_isa'])}".lower()
    return re.sub(r"[^a-z0-9]+", "-", name.replace("(r)", "").replace("(tm)", "")).strip("-")

def tree_diff():
    """The uncommitted changes to tracked files (git diff HEAD): '' on a clean tree."""
    git = ["git", "-C", ROOT, "diff", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout

def finished(folder, readings_too=True):
    """Its metrics reach its last step (args.json's) and its readings are in."""
    try:
        args = json.load(open(os.path.join(folder, "args.json")))
        rows = sum(1 for _ in open(os.path.join(folder, "metrics.jsonl")))
        files = readings(os.path.basename(folder)) if readings_too else ("hf/config.json",)
        present = all(os.path.isfile(os.path.join(folder, f)) for f in files)
        return rows >= (args.get("stop_after") or args["steps"]) and present
    except (OSError, ValueError, KeyError):
        return False

def readings(name):
    return ("heldout.json", "probe.json") if probed(name) else ("heldout.json",)

def option(flags, name):
    """The value of a train_grpo.py flag in a run's flags, or None."""
    return flags[flags.index(name) + 1] if name in flags else None

def commands(name, flags, opts, args, results):
    """The commands of one run, in order: train (or resume) it, read its held-out accuracy,
    and in PROBED arms its mismatch on identical tokens (its seed's warm start's once)."""
    out, py, seed = os.path.join(args.runs, name), sys.executable, option(flags, "--seed")
    kept = os.path.isfile(os.path.join(out, "checkpoint.pt"))
    if not kept and os.path.isdir(out):
        shutil.rmtree(out)  # killed before its first checkpoint: nothing to keep
    stop = None if kept else earlier_stop(args, name)
    if stop:
        skip = shutil.ignore_patterns("hf", "*.json")  # its end, its readings
        shutil.copytree(stop, out, ignore=skip)  # resume is exact
    resume = ["--resume"] if kept or stop else []
    until = ["--stop-after", str(args.stop_after)] if args.stop_after else []
    if "--dial" in opts:  # the chip's calibration (dial.py calibrate)
        opts = [*opts, "--dial-calibration", os.path.join(results, "dial.json")]
    train = [py, "experiments/campaign.py", "--run", *until, *opts, "--", *flags,
             *args.extra, "--out", out, *resume]
    items = option(flags, "--n-items")
    heldout = [py, "experiments/heldout.py", "--init", os.path.join(out, "hf"), "--seed", seed,
               "--samples", str(args.samples), *(["--n-items", items] if items else []),
               "--json", os.path.join(out, "heldout.json")]
    stopped = args.stop_after and finished(out, readings_too=False)  # a resume would go past N
    steps = ([] if stopped else [train]) + [heldout]
    if probed(name):
        probe = [py, "experiments/mismatch.py", "--quick", "--group-size", "4", "--seed", seed]
        policy = ["--init", os.path.join(out, "hf"), "--json", os.path.join(out, "probe.json")]
        steps.append(probe + policy)
        warm = os.path.join(results, f"warmstart-s{seed}", "probe.json")
        if not os.path.isfile(warm):
            os.makedirs(os.path.dirname(warm), exist_ok=True)
            steps.append(probe + ["--json", warm])
    return steps

def swap_of(name):
    """A run's swap variant (plans.SWAPS), or None."""
    return next((v for v in SWAPS if f"-{v}-s" in name), None)

def swap_source(args, name):
    """A swap run's start (plans.SWAPS): its before variant's stop at
    its swap's update N, in runs/campaign/stepN/; None for any other."""
    variant = swap_of(name)
    if variant is None:
        return None
    before, _, step = SWAPS[variant]
    base = os.path.dirname(args.runs) if args.stop_after else args.runs
    return os.path.join(base, f"step{step}", name.replace(f"-{variant}-s", f"-{before}-s"))

def refuse_unswappable(todo, args):
    """One line, before any work, where a swap run has nothing to start from."""
    for name, _, _ in todo:
        start = swap_source(args, name)
        kept = os.path.isfile(os.path.join(args.runs, name, "checkpoint.pt"))
        if start and not kept and not finished(start, readings_too=False):
            refuse(f"{name}: no stop in {start}: first campaign.py --plan swap-stops "
                   f"--stop-after {SWAPS[swap_of(name)][2]} with the same --seeds")

def earlier_stop(args, name):
    """This run's folder at the latest --stop-after below this one (any,
    for a whole run), if kept with its checkpoint: it goes on from there."""
    source = swap_source(args, name)
    if source:  # a swap goes on from its before side's stop alone
        return source
    base = os.path.dirname(args.runs) if args.stop_after else args.runs
    limit, stops = args.stop_after or float("inf"), []
    for d in os.listdir(base) if os.path.isdir(base) else []:
        m = re.fullmatch(r"step(\d+)", d)
        stops += [int(m.group(1))] if m and int(m.group(1)) < limit else []
    for n in sorted(stops, reverse=True):
        folder = os.path.join(base, f"step{n}", name)
        if finished(folder, readings_too=False):
            return folder
    return None

def run_one(name, flags, opts, args, results):
    """One run's commands, then its small files (and the tree's diff, if any) to results."""
    steps = commands(name, flags, opts, args, results)
    if any(subprocess.run(cmd, cwd=ROOT).returncode != 0 for cmd in steps):
        return False  # in order, stops at a failure
    out, keep = os.path.join(args.runs, name), os.path.join(results, name)
    os.makedirs(keep + ".tmp", exist_ok=True)
    for f in ("args.json", "metrics.jsonl", *readings(name)):
        shutil.copy(os.path.join(out, f), os.path.join(keep + ".tmp", f))
    if args.diff:
        open(os.path.join(keep + ".tmp", "diff.patch"), "w").write(args.diff)
    shutil.rmtree(keep, ignore_errors=True)
    os.replace(keep + ".tmp", keep)  # the results folder holds whole runs only
    return True

def train_run(argv, stop_after, dial=None, library=None, rotary_torch=False,
              hide_amx=False, swap_from=None):
    """One run: train_grpo.py's flags, the instruments on, the machine in args.json; with
    stop_after n, ended after its n-th update on the schedule of all --steps (stop_after
    recorded), its policy in hf/ as a whole run's; with dial (dose, shape, calibration file),
    its engine perturbed by dial.py; with library, vLLM's kernels from
    that library (the trainer's too, on them); with rotary_torch, the
    rotary embedding on torch; with hide_amx, vLLM's AMX kernels hidden;
    with swap_from, the variant whose stop it goes on from (recorded)."""
    import instruments
    import train_grpo

    args = train_grpo.get_args(argv)
    record, more = {"machine": machine()}, {}
    if library or hide_amx:
        from rounding import load  # before the engine: one a process

        record["kernel_library"] = load(library, amx=not hide_amx)
    if hide_amx:
        record["amx_hidden"] = True
    if swap_from:  # its rows before swap_step are that variant's
        record.update(swap_from=swap_from, swap_step=swap_step(args.out))
    if rotary_torch:  # vLLM keeps its first engine's: one a process
        more["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
        record["engine_custom_ops"] = ["-rotary_embedding"]
    if stop_after:
        record["stop_after"] = min(stop_after, args.steps)
    if dial:
        import dial as dial_module  # vLLM's logits processor: only when asked

        dialed_engine, dialed = dial_module.dial_run_args(dial[2], dial[1], dial[0])
        more.update(dialed_engine)
        record.update(dialed)
    train_grpo.train(args, instruments=instruments, record=record,
                     until=record.get("stop_after"), more=more)

def swap_step(out):
    """The update a swap run changed library at: as its args.json says
    on a later resume, else the rows it starts with (the stop's)."""
    old = load(os.path.join(out, "args.json")) or {}
    if "swap_step" in old:
        return old["swap_step"]
    return sum(1 for _ in open(os.path.join(out, "metrics.jsonl")))

def get_args(argv):
    p = parser("every RL run of a plan, once, resumable (the docstring)")
    p.add_argument("--plan", default="campaign", choices=list(PLANS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--arms", nargs="+", default=None, help="only these arms of the plan")
    p.add_argument("--samples", type=int, default=8, help="held-out samples of each problem")
    p.add_argument("--runs", default=os.path.join("runs", "campaign"), help="where runs work")
    p.add_argument("--results", default="results", help="finished runs' small files, by machine")
    p.add_argument("--list", action="store_true", help="the plan and what is done; run nothing")
    p.add_argument("--stop-after", type=int, default=None, help="end runs after update N")
    p.add_argument("--allow-dirty", action="store_true", help="keep the diff beside each run")
    p.add_argument("--run", action="store_true", help="one run of train_grpo.py's flags after --")
    p.add_argument("--dial", type=int, default=None, help="--run: the dial's dose (dial.py)")
    p.add_argument("--dial-shape", default="uniform", choices=DIAL_SHAPES)
    p.add_argument("--dial-calibration", default=None, help="--run: dial.py calibrate's JSON")
    p.add_argument("--library", default=None, choices=list(LIBRARIES),
                   help="--run: vLLM's kernels from this library (rounding.py)")
    p.add_argument("--rotary-torch", action="store_true",
                   help="--run: rotary on torch's path")
    p.add_argument("--hide-amx", action="store_true",
                   help="--run: vLLM's AMX kernels hidden (rounding.py)")
    p.add_argument("--swap-from", default=None, choices=BEFORE,
                   help="--run: went on from this variant's stop (plans.SWAPS)")
    p.add_argument("extra", nargs="*", help="after --: more train_grpo.py flags for every run")
    args = p.parse_args(argv)
    if args.samples < 1 or (args.stop_after or 1) < 1:
        p.error(f"--samples and --stop-after must be >= 1, got {args.samples} and "
                f"{args.stop_after}")
    refuse_unrunnable(args.library, args.hide_amx)  # one line, before any work
    if args.swap_from and "--resume" not in args.extra:
        refuse("--swap-from: a swap goes on from a stop: give --resume and its --out")
    unknown = set(args.arms or []) - {arm for arm, _ in PLANS[args.plan]}
    if unknown:
        p.error(f"--arms: {sorted(unknown)} not in plan {args.plan}")
    return args

def main(argv=None):
    args = get_args(argv)
    if args.run:
        dial = (args.dial, args.dial_shape, args.dial_calibration) if args.dial else None
        return train_run(args.extra, args.stop_after, dial, args.library,
                         args.rotary_torch, args.hide_amx, args.swap_from)
    os.chdir(ROOT)
    stopped = [f"step{args.stop_after}"] if args.stop_after else []  # mid-run: their own folder
    results = os.path.join(args.results, machine_group(machine()), *stopped)
    args.runs = os.path.join(args.runs, *stopped)
    runs = plan_runs(args.plan, args.seeds, args.arms, machine()["cpu_isa"])
    todo = [(n, f, d) for n, f, d in runs if not finished(os.path.join(results, n))]
    done = len(runs) - len(todo)
    print(f"plan {args.plan}: {len(runs)} runs, {done} done in {results}", flush=True)
    if args.list:
        return print("\n".join(f"  {'todo' if r in todo else 'done'}  {r[0]}" for r in runs))
    args.diff = tree_diff()
    if args.diff and not args.allow_dirty:
        refuse("the tree has uncommitted changes: commit them, or --allow-dirty to keep the "
               "diff beside each run")
    refuse_unswappable(todo, args)
    if args.plan == "dial" and not os.path.isfile(os.path.join(results, "dial.json")):
        refuse(f"--plan dial: no {results}/dial.json: run experiments/dial.py calibrate first")
    os.makedirs(results, exist_ok=True)
    run_all(todo, len(runs), args, results)

def run_all(todo, total, args, results):
    timed, done = [], total - len(todo)
    for i, (name, flags, opts) in enumerate(todo):
        t0 = time.time()
        print(f"[{done + i + 1}/{total}] {name}", flush=True)
        if not run_one(name, flags, opts, args, results):
            print(f"campaign: {name} failed (its output is above); going on with the next run",
                  flush=True)
            continue
        timed.append(time.time() - t0)
        left = (len(todo) - i - 1) * sum(timed) / len(timed)
        print(f"[{done + i + 1}/{total}] {name} done in {timed[-1]:.0f} s; about "
              f"{left / 3600:.1f} h left at this pace", flush=True)

if __name__ == "__main__":
    main()
