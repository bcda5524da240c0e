"""
experiments/campaign.py: every RL run of a plan (plans.py), each (arm, variant, seed) once,
resumable: stop it at any moment, run the same command again, and it goes on where it stopped.

    nohup python experiments/campaign.py > runs/campaign.log 2>&1 &   # the plan, in priority order
    python experiments/campaign.py --list                              # what is done, what is left
    python experiments/campaign.py --plan extend --seeds 5 6 7         # more seeds of a plan
    python experiments/campaign.py --plan midrun --stop-after 8        # arm 1 after 8 of 40 steps
    python experiments/campaign.py --arms grpo --variants bf16 fp16    # any variants, on an arm

A run is `train_grpo.py --seed S` with its arm's and variant's flags, in
runs/campaign/ARM-VARIANT-sS (--seed picks the warm start too: one per seed, cached, unless the
variant names another seed's); a run left half done is resumed. A finished run's policy is read
by one fp32 engine (heldout.py; in PROBED arms also by mismatch.py --quick, and each seed's warm
start once), then its small files go to results/<machine>/: committed, skipped next time, what
the figures are drawn from. <machine> is the CPU model and the ISA features vLLM's kernels read:
runs are paired only within one machine's folder, and a CPU new to a folder (its family/model/
stepping) is refused there until its seed-0 runs, made apart, repeat the folder's.
--stop-after N ends every run after its N-th update (of its own schedule: its rows equal the
whole run's) and reads that policy; results/<machine>/stepN/ keeps them; a later stop, or the
whole run, goes on from an earlier stop's checkpoint where it is kept (resume is exact). A run's
variant reaches --run by name (--variant): its record (variants.py) gives the engine's options,
one value from here to rollout.start_engine. A campaign refuses a tree with uncommitted changes
to tracked files, unless --allow-dirty, which keeps the diff beside each run (diff.patch): a
result names its code.
"""
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

from common import ROOT, load, parser, refuse
from instruments import machine
from plans import PLANS, plan_runs, probed
from rounding import refuse_unrunnable
from variants import VARIANTS, formats, option, parse_run

def machine_group(m):
    """results/ subfolder name: the CPU (or GPU) model and the ISA features, as a slug."""
    name = f"{m['gpu'] or m['cpu']} {' '.join(m['cpu_isa'])}".lower()
    return re.sub(r"[^a-z0-9]+", "-", name.replace("(r)", "").replace("(tm)", "")).strip("-")

def refuse_new_cpu(group, cpu_id):
    """One line where the group's folder holds runs and none of this CPU's family/model/stepping:
    one ISA's CPUs have repeated each other bit for bit so far, but a new one joins a folder
    only once its seed-0 runs, made apart (--results elsewhere), repeat the folder's
    (provenance.md, Machines); moved in as <family>-<model>-<stepping>-reruns/, they admit it."""
    found = glob.glob(os.path.join(group, "**", "args.json"), recursive=True)
    seen = {json.load(open(a))["machine"].get("cpu_id") for a in found} - {None}
    if seen and cpu_id not in seen:  # runs from before cpu_id was recorded say nothing
        refuse(f"{group} holds runs of cpu_id {', '.join(sorted(seen))}, none of this CPU's "
               f"{cpu_id}: repeat seed 0 with --results elsewhere, compare (provenance.md), "
               f"then move those runs in as {cpu_id.replace('/', '-')}-reruns/")

def tree_diff():
    """The uncommitted changes to tracked files (git diff HEAD): '' on a clean tree."""
    git = ["git", "-C", ROOT, "diff", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True).stdout

def code_version():
    """The commit, and whether a tracked .py differs from it: what computed a run."""
    def git(*cmd):
        return subprocess.run(["git", "-C", ROOT, *cmd], capture_output=True, text=True)

    head = git("rev-parse", "HEAD") if shutil.which("git") else None
    if not head or head.returncode:  # no git, or not a checkout
        return {"commit": None, "dirty": None}
    changed = git("status", "--porcelain", "-uno", "--", "*.py").stdout
    return {"commit": head.stdout.strip(), "dirty": bool(changed.strip())}

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

def commands(name, flags, variant, args, results):
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
    opts = ["--variant", variant.name]
    if variant.dial:  # the chip's calibration (dial.py calibrate)
        opts += ["--dial-calibration", os.path.join(results, "dial.json")]
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

def swap_source(args, name):
    """A swap run's start (a variant with a swap): its before variant's stop at its swap's
    update N, in runs/campaign/stepN/; None for any other run."""
    arm, variant, seed = parse_run(name)
    if not variant.swap:
        return None
    before, step = variant.swap
    base = os.path.dirname(args.runs) if args.stop_after else args.runs
    return os.path.join(base, f"step{step}", f"{arm}-{before}-s{seed}")

def refuse_unswappable(todo, args):
    """One line, before any work, where a swap run has nothing to start from."""
    for name, _, _ in todo:
        start = swap_source(args, name)
        kept = os.path.isfile(os.path.join(args.runs, name, "checkpoint.pt"))
        if start and not kept and not finished(start, readings_too=False):
            before, step = parse_run(name)[1].swap
            refuse(f"{name}: no stop in {start}: first campaign.py --plan swap-stops "
                   f"--variants {before} --stop-after {step} with the same --seeds")

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

def run_one(name, flags, variant, args, results):
    """One run's commands, then its small files (and the tree's diff, if any) to results."""
    steps = commands(name, flags, variant, args, results)
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

def train_run(argv, stop_after, variant, calibration=None):
    """One run: train_grpo.py's flags, the instruments on, the commit and the machine in
    args.json; with stop_after n, ended after its n-th update on the schedule of all --steps
    (stop_after recorded), its policy in hf/ as a whole run's. The variant's record gives the
    engine's options (its kernel library, AMX hidden, the rotary on torch, the dial with its
    calibration file; the trainer's site rounding; another seed's warm start) and what args.json
    records of them (variants.py's table)."""
    import instruments
    import train_grpo

    args = train_grpo.get_args(argv)
    record, engine_options = {**code_version(), "machine": machine()}, {}
    if variant.library or variant.hide_amx:
        from rounding import load  # before the engine: one a process

        record["kernel_library"] = load(variant.library, amx=not variant.hide_amx)
    if variant.hide_amx:
        record["amx_hidden"] = True
    if variant.swap:  # its rows before swap_step are the before variant's
        record.update(swap_from=variant.swap[0], swap_step=swap_step(args.out))
    if variant.site_rounding != "rne":  # the trainer's side: one mode a process
        import sites

        record["site_rounding"] = sites.install(variant.site_rounding)
    if variant.embed_grad != "dtype":  # after the sites': it wraps the trainer's mode as it is
        import embed32

        record["embed_grad"] = embed32.install(variant.embed_grad)
    if variant.attention_weights != "float32":  # a fused kernel's, the sites' left at rne
        import fused

        record["attention_weights"] = fused.install()
    if variant.warm_seed is not None:  # another seed's start; the task, the stream the run's
        record["warm_seed"] = variant.warm_seed
    if variant.init_seed is not None:  # the start's initial weights another seed's
        record["init_seed"] = variant.init_seed
    if variant.warm_seed is not None or variant.init_seed is not None:
        start = args.seed if variant.warm_seed is None else variant.warm_seed
        args.init = warm_init(args, start, variant.init_seed)
    if variant.rotary_torch:  # vLLM keeps its first engine's: one a process
        engine_options["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
        record["engine_custom_ops"] = ["-rotary_embedding"]
    if stop_after:
        record["stop_after"] = min(stop_after, args.steps)
    if variant.dial:
        import dial  # vLLM's logits processor: only when asked

        dose, shape = variant.dial
        dialed_engine, dialed = dial.dial_run_args(calibration, shape, dose)
        engine_options.update(dialed_engine)
        record.update(dialed)
    train_grpo.train(args, instruments=instruments, record=record,
                     until=record.get("stop_after"), engine_options=engine_options)

def warm_init(args, seed, init_seed=None):
    """The warm start a run of `seed` with these flags starts from (warm_start.py: trained
    once, cached by all that sets it), for a run that keeps its own seed for the rest; with
    init_seed, that start trained from init_seed's initial weights (initial_weights_of)."""
    import warm_start
    from precision import get_precision

    cfg = warm_start.model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head,
                                  args.n_embd)
    device = get_precision(args.dtype, args.engine_dtype, args.lm_head).device
    split = contextlib.nullcontext() if init_seed is None else initial_weights_of(init_seed, seed)
    with split:
        return warm_start.warm_start(cfg, args.n_items, seed, device)

@contextlib.contextmanager
def initial_weights_of(init_seed, seed):
    """Inside it, warm_start.py trains seed's start from init_seed's initial weights: its
    torch seed for the init (task.seed_of("init", seed)) answers init_seed's; every other draw
    (splits, batches, noise) stays seed's. Its checkpoints apart, in WARMSTART_DIR/init<I>:
    the cache's key names seed alone."""
    import task
    import warm_start

    own, folder = task.seed_of, warm_start.WARMSTART_DIR

    def seed_of(*parts):
        return own("init", init_seed) if parts == ("init", seed) else own(*parts)

    task.seed_of, warm_start.WARMSTART_DIR = seed_of, os.path.join(folder, f"init{init_seed}")
    try:
        yield
    finally:
        task.seed_of, warm_start.WARMSTART_DIR = own, folder

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
    p.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                   help="these variants on the plan's arms, not the plan's own")
    p.add_argument("--samples", type=int, default=8, help="held-out samples of each problem")
    p.add_argument("--runs", default=os.path.join("runs", "campaign"), help="where runs work")
    p.add_argument("--results", default="results", help="finished runs' small files, by machine")
    p.add_argument("--list", action="store_true", help="the plan and what is done; run nothing")
    p.add_argument("--stop-after", type=int, default=None, help="end runs after update N")
    p.add_argument("--allow-dirty", action="store_true", help="keep the diff beside each run")
    p.add_argument("--run", action="store_true", help="one run of train_grpo.py's flags after --")
    p.add_argument("--variant", default="fp16", choices=list(VARIANTS),
                   help="--run: its record's engine options (variants.py)")
    p.add_argument("--dial-calibration", default=None, help="--run: dial.py calibrate's JSON")
    p.add_argument("extra", nargs="*", help="after --: more train_grpo.py flags for every run")
    args = p.parse_args(argv)
    if args.samples < 1 or (args.stop_after or 1) < 1:
        p.error(f"--samples and --stop-after must be >= 1, got {args.samples} and "
                f"{args.stop_after}")
    if args.run:
        refuse_unfit(VARIANTS[args.variant], args)  # one line, before any work
    unknown = set(args.arms or []) - {arm for arm, _ in PLANS[args.plan]}
    if unknown:
        p.error(f"--arms: {sorted(unknown)} not in plan {args.plan}")
    return args

def refuse_unfit(variant, args):
    """--run: one line where the variant cannot run here or as asked."""
    refuse_unrunnable(variant.library, variant.hide_amx)  # the chip's libraries, its AMX
    if variant.swap and "--resume" not in args.extra:
        refuse(f"--variant {variant.name}: a swap goes on from a stop: give --resume and its "
               "--out")
    if variant.dial and not args.dial_calibration:
        refuse(f"--variant {variant.name}: the dial needs --dial-calibration (dial.py calibrate)")
    if variant.site_rounding != "rne" and machine()["gpu"]:  # sites.py: the CPU trainer's
        refuse(f"--variant {variant.name}: the site rounding is the CPU trainer's; this is a GPU")
    if variant.embed_grad != "dtype" and machine()["gpu"]:  # a GPU's kernel sums its own way
        refuse(f"--variant {variant.name}: the embedding's sums (embed32.py) are the CPU "
               "trainer's; this is a GPU, whose kernel sums in float32")
    if variant.attention_weights != "float32" and machine()["gpu"]:  # its fused kernel does
        refuse(f"--variant {variant.name}: the fused attention is the CPU trainer's model of a "
               "GPU's kernel; this is a GPU")
    if variant.warm_seed is not None and "--init" in args.extra:  # two starts named
        refuse(f"--variant {variant.name}: it starts from seed {variant.warm_seed}'s warm start; "
               "drop --init")
    if variant.init_seed is not None and "--init" in args.extra:
        refuse(f"--variant {variant.name}: its warm start has seed {variant.init_seed}'s "
               "initial weights; drop --init")
    if formats(args.extra) != formats(variant.flags):  # args.json would name another
        refuse(f"--variant {variant.name}: its flags are {' '.join(variant.flags)}, the "
               f"run's formats {formats(args.extra)}")

def main(argv=None):
    args = get_args(argv)
    if args.run:
        variant = VARIANTS[args.variant]
        return train_run(args.extra, args.stop_after, variant, args.dial_calibration)
    os.chdir(ROOT)
    stopped = [f"step{args.stop_after}"] if args.stop_after else []  # mid-run: their own folder
    results = os.path.join(args.results, machine_group(machine()), *stopped)
    args.runs = os.path.join(args.runs, *stopped)
    runs = plan_runs(args.plan, args.seeds, args.arms, machine()["cpu_isa"], args.variants)
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
    refuse_new_cpu(os.path.join(args.results, machine_group(machine())), machine()["cpu_id"])
    if args.plan == "dial" and not os.path.isfile(os.path.join(results, "dial.json")):
        refuse(f"--plan dial: no {results}/dial.json: run experiments/dial.py calibrate first")
    os.makedirs(results, exist_ok=True)
    run_all(todo, len(runs), args, results)

def run_all(todo, total, args, results):
    timed, done = [], total - len(todo)
    for i, (name, flags, variant) in enumerate(todo):
        t0 = time.time()
        print(f"[{done + i + 1}/{total}] {name}", flush=True)
        if not run_one(name, flags, variant, args, results):
            print(f"campaign: {name} failed (its output is above); going on with the next run",
                  flush=True)
            continue
        timed.append(time.time() - t0)
        left = (len(todo) - i - 1) * sum(timed) / len(timed)
        print(f"[{done + i + 1}/{total}] {name} done in {timed[-1]:.0f} s; about "
              f"{left / 3600:.1f} h left at this pace", flush=True)

if __name__ == "__main__":
    main()
