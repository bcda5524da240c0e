"""
experiments/campaign.py: every RL run of a plan, each (arm, variant, seed) once, resumable: stop
it at any moment, run the same command again, and it goes on where it stopped.

    nohup python experiments/campaign.py > runs/campaign.log 2>&1 &   # the plan, in priority order
    python experiments/campaign.py --list                              # what is done, what is left
    python experiments/campaign.py --plan extend --seeds 5 6 7     # arm 1's borderline cells
    python experiments/campaign.py --plan midrun --stop-after 8    # arm 1 after 8 of 40 steps

A run is `train_grpo.py --seed S` with its arm's and variant's flags, in
runs/campaign/ARM-VARIANT-sS (--seed picks the warm start too: one per seed, cached); a run left
half done is resumed. A finished run's policy is read by one fp32 engine (probe.py heldout; in
PROBED arms also by probe.py mismatch --quick, and each seed's warm start once), then its small
files go to results/<machine>/: committed, skipped next time, what plot.py draws from. <machine>
is the CPU model and the ISA features vLLM's kernels read: runs are paired only within one
machine's folder. --stop-after N ends every run after its N-th update (of its own schedule: its
rows equal the whole run's) and reads that policy; results/<machine>/stepN/ keeps them."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]  # the core, and this folder, from anywhere
from instruments import machine  # noqa: E402

ARMS = {  # the flags every variant of an arm shares
    "gspo-engine": [
        "--algorithm",
        "gspo",
        "--behavior-logp",
        "engine",
    ],  # the mismatch inside the trust region
    "drgrpo-mb4": ["--dr-grpo", "--minibatches", "4"],  # the paper's recipe
    "grpo": [],  # the default run
    "gspo": ["--algorithm", "gspo"],  # arm 1 without the mismatch in it
    "seq-mis-engine": [
        "--algorithm",
        "seq-mis",
        "--behavior-logp",
        "engine",
    ],  # the paper's patches
    "pg-seq-is": ["--algorithm", "pg-seq-is"],
    "token-tis": ["--algorithm", "token-tis"],  # pi_old the trainer's: w_t = pi_old / mu
}
# The dial's length arms: responses of 2 x 20 tokens, not 2 x 12. 24 items' warm start reaches
# only 0.78 held-out on the Intel Xeon with AMX (seed 0), 20 items' 0.85 (experiments/README.md 9).
LENGTH_ITEMS = 20
for arm in ("grpo", "gspo-engine"):
    ARMS[f"{arm}-len{LENGTH_ITEMS}"] = [*ARMS[arm], "--n-items", str(LENGTH_ITEMS)]
VARIANTS = {
    "fp16": ["--dtype", "fp16"],
    "bf16": ["--dtype", "bf16"],
    "fp32": ["--dtype", "fp32"],
    "bf16-head32": ["--dtype", "bf16", "--lm-head", "fp32"],
    "bf16-engine32": ["--dtype", "bf16", "--engine-dtype", "fp32"],
    "bf16-aligned": ["--dtype", "bf16", "--trainer-kernels", "engine"],
}
PLANS = {  # arms in priority order, each with its variants
    "campaign": [
        (
            "gspo-engine",
            ["fp16", "bf16", "fp32", "bf16-head32", "bf16-engine32", "bf16-aligned"],
        ),
        ("drgrpo-mb4", ["fp16", "bf16", "fp32", "bf16-aligned"]),
        ("grpo", ["fp16", "bf16", "fp32", "bf16-aligned"]),
        ("gspo", ["fp16", "bf16"]),
        ("seq-mis-engine", ["fp16", "bf16"]),
        ("pg-seq-is", ["fp16", "bf16"]),
    ],
    "extend": [
        ("gspo-engine", ["fp16", "bf16", "fp32", "bf16-aligned"])
    ],  # arm 1's borderline cells, --seeds 5 6 7
    "extend-grpo": [
        ("grpo", ["fp16", "bf16", "fp32", "bf16-aligned"])
    ],  # arm 3's borderline cells, --seeds 5 6 7
    "extend-gspo": [
        ("gspo", ["fp16", "bf16"])
    ],  # arm 4 against arm 1's seeds 5-7 (#24's ablation), --seeds 5 6 7
    "extend-rest": [
        ("gspo-engine", ["bf16-head32", "bf16-engine32"]),
        ("drgrpo-mb4", ["fp16", "bf16", "fp32", "bf16-aligned"]),
        ("seq-mis-engine", ["fp16", "bf16"]),
        ("pg-seq-is", ["fp16", "bf16"]),
    ],  # the cells left at five, --seeds 5 6 7
    "midrun": [
        ("gspo-engine", ["fp16", "bf16"])
    ],  # #24's cross-probe at the mismatch's peak, with --stop-after
    "smoke": [("grpo", ["fp32"])],  # the tests' plan: one run per seed
}
# The mismatch dial (dial.py): the bf16 trainer on the engine's kernels (mismatch 0) with the
# engine's logits perturbed, DOSE x the chip's bf16 mismatch on the warm start, in two shapes.
DIAL_DOSES = (1, 3, 10, 30, 100)
for shape in ("uniform", "bf16"):
    for dose in DIAL_DOSES:
        VARIANTS[f"bf16-aligned-dial{dose}-{shape}"] = VARIANTS["bf16-aligned"]

def by_dose(arms, doses, shape="uniform"):
    """(arm, variants) of each arm at each dose, in the order given; the first (top) dose's
    entry carries dose 0, the aligned run itself (once: both shapes' control)."""
    return [
        (
            arm,
            ["bf16-aligned"] * (shape == "uniform" and d == doses[0])
            + [f"bf16-aligned-dial{d}-{shape}"],
        )
        for arm in arms
        for d in doses
    ]

# Dose by dose from the top, every seed of one before the next (a run is ~14 min on 2 cores):
# the top dose against dose 0 first, the contrast that answers most, paired as it lands.
# grpo and gspo-engine in both shapes first, then the paper's recipe.
PLANS["dial"] = [
    entry
    for arms in (("grpo", "gspo-engine"), ("drgrpo-mb4",))
    for shape in ("uniform", "bf16")
    for entry in by_dose(arms, DIAL_DOSES[::-1], shape)
]

# The length arms at two doses: 10x, where gspo-engine's loss passes 0.01 held-out on the Intel
# Xeon with AMX (13x, uniform, n = 5), and 100x, the top, where vanilla GRPO would lose first.
LENGTH_DOSES = (100, 10)
PLANS["dial-length"] = by_dose(
    [f"{a}-len{LENGTH_ITEMS}" for a in ("grpo", "gspo-engine")], LENGTH_DOSES
)

# The fixes at the doses where harm shows: gspo-engine loses from 10x on the Intel Xeon with
# AMX (section 9). First gspo with the trainer's pi_old, the ablation of the mechanism (the
# mismatch out of the clip), then the patches; each against its own dose 0.
PATCH_DOSES = (100, 10)
PLANS["dial-patches"] = by_dose(
    ("gspo", "token-tis", "seq-mis-engine", "pg-seq-is"), PATCH_DOSES
)

# The paper's recipe's tail (exploratory, section 9): one run in 25 of its bf16-shaped dial
# (10x, seed 3) did not recover from the dip that every seed of it shows at dose 0. Ten new
# seeds at dose 0 and that dose: --seeds 5 6 7 8 9 10 11 12 13 14.
PLANS["dial-tail"] = [("drgrpo-mb4", ["bf16-aligned", "bf16-aligned-dial10-bf16"])]

def dial_of(variant):
    """(dose, shape) of a dial variant, or None."""
    m = re.search(r"-dial(\d+)-(\w+)$", variant)
    return (int(m.group(1)), m.group(2)) if m else None

PROBED = (
    "gspo-engine",
)  # arms whose final policies (and each seed's warm start) probe.py also reads in bf16 and fp16

def probed(name):  # the dial's and the length arms' runs are read by held-out accuracy alone
    arm = name.startswith(tuple(f"{arm}-" for arm in PROBED))
    return arm and "-dial" not in name and "-len" not in name

def machine_group(m):
    """results/ subfolder name: the CPU (or GPU) model and the ISA features, as a slug."""
    name = f"{m['gpu'] or m['cpu']} {' '.join(m['cpu_isa'])}".lower()
    return re.sub(r"[^a-z0-9]+", "-", name.replace("(r)", "").replace("(tm)", "")).strip("-")

def plan_runs(args):
    """(name, flags) of every run: arm by arm, in an arm seed by seed: however far it got, an arm's
    variants have the same seeds, paired."""
    return [
        (f"{arm}-{v}-s{seed}", ["--seed", str(seed), *ARMS[arm], *VARIANTS[v]], dial_options(v))
        for arm, variants in PLANS[args.plan]
        if arm in (args.arms or [arm])  # --arms: those arms' runs alone, in the plan's order
        for seed in args.seeds
        for v in variants
    ]

def dial_options(variant):
    """campaign.py --run's options for a dial variant: its dose and shape."""
    dial = dial_of(variant)
    return ["--dial", str(dial[0]), "--dial-shape", dial[1]] if dial else []

def finished(
    folder, readings_too=True
):  # its metrics reach its last step (args.json's) and its readings are in
    try:
        args = json.load(open(os.path.join(folder, "args.json")))
        rows = sum(1 for _ in open(os.path.join(folder, "metrics.jsonl")))
        files = readings(os.path.basename(folder)) if readings_too else ("hf/config.json",)
        return rows >= (args.get("stop_after") or args["steps"]) and all(
            os.path.isfile(os.path.join(folder, f)) for f in files
        )
    except (OSError, ValueError, KeyError):
        return False

def readings(name):
    return ("heldout.json", "probe.json") if probed(name) else ("heldout.json",)

def option(flags, name):
    """The value of a train_grpo.py flag in a run's flags, or None."""
    return flags[flags.index(name) + 1] if name in flags else None

def heldout_command(out, flags, samples):
    """probe.py heldout on a run's policy: its seed's problems, and its length's."""
    items = option(flags, "--n-items")
    seed = option(flags, "--seed")
    policy = os.path.join(out, "hf")
    return [
        sys.executable,
        "experiments/probe.py",
        "heldout",
        "--init",
        policy,
        "--seed",
        seed,
        "--samples",
        str(samples),
        *(["--n-items", items] if items else []),
        "--json",
        os.path.join(out, "heldout.json"),
    ]

def run_one(name, flags, dial_opts, args, results):
    """Train (or resume) one run, read its policy's held-out accuracy (and, in PROBED arms, its
    mismatch on identical tokens in bf16 and fp16 and per layer: probe.py mismatch --quick, the
    seed's warm start's too), copy its small files."""
    out = os.path.join(args.runs, name)
    resume = ["--resume"] if os.path.isfile(os.path.join(out, "checkpoint.pt")) else []
    if not resume and os.path.isdir(out):
        shutil.rmtree(out)  # killed before its first checkpoint: nothing to keep
    until = ["--stop-after", str(args.stop_after)] if args.stop_after else []
    if dial_opts:  # the chip's calibration, in its results folder (dial.py calibrate)
        dial_opts = [*dial_opts, "--dial-calibration", os.path.join(results, "dial.json")]
    train = [
        sys.executable,
        "experiments/campaign.py",
        "--run",
        *until,
        *dial_opts,
        "--",
        *flags,
        *args.extra,
        "--out",
        out,
        *resume,
    ]
    heldout = heldout_command(out, flags, args.samples)
    stopped = args.stop_after and finished(
        out, readings_too=False
    )  # a resume would go on past step N: read it
    steps = ([] if stopped else [train]) + [heldout]
    if probed(
        name
    ):  # the policy's mismatch on identical tokens in bf16 and fp16 and per layer; the warm start's once
        seed = option(flags, "--seed")
        probe = [
            sys.executable,
            "experiments/probe.py",
            "mismatch",
            "--quick",
            "--group-size",
            "4",
            "--seed",
            seed,
        ]
        warm = os.path.join(results, f"warmstart-s{seed}", "probe.json")
        steps.append(
            probe
            + ["--init", os.path.join(out, "hf"), "--json", os.path.join(out, "probe.json")]
        )
        if not os.path.isfile(warm):
            os.makedirs(os.path.dirname(warm), exist_ok=True)
            steps.append(probe + ["--json", warm])
    if any(
        subprocess.run(cmd, cwd=ROOT).returncode != 0 for cmd in steps
    ):  # in order, stops at a failure
        return False
    keep = os.path.join(results, name)
    os.makedirs(keep + ".tmp", exist_ok=True)
    for f in ("args.json", "metrics.jsonl", *readings(name)):
        shutil.copy(os.path.join(out, f), os.path.join(keep + ".tmp", f))
    shutil.rmtree(keep, ignore_errors=True)
    os.replace(keep + ".tmp", keep)  # the results folder holds whole runs only
    return True

def train_run(argv, stop_after, dial=None):
    """One run: train_grpo.py's flags, the instruments on, the machine in args.json; with
    stop_after n, ended after its n-th update on the schedule of all --steps (stop_after
    recorded), its policy in hf/ as a whole run's; with dial (dose, shape, calibration file),
    its engine perturbed by dial.py, started here as train() would start it."""
    import instruments
    import train_grpo

    args = train_grpo.get_args(argv)
    record, llm = {"machine": machine()}, None
    if stop_after:
        record["stop_after"] = min(stop_after, args.steps)
    if dial:
        llm, more = dial_engine(args, *dial)
        record.update(more)
    train_grpo.train(
        args, llm=llm, instruments=instruments, record=record, until=record.get("stop_after")
    )

def dial_engine(args, dose, shape, calibration):
    """The run's engine, as train() starts it, with the dial's processor (none at dose 0)."""
    import dial
    from precision import get_precision
    from rollout import start_engine
    from warm_start import model_config, warm_start

    more, record = dial.dial_run_args(calibration, shape, dose)
    prec = get_precision(
        args.dtype, args.engine_dtype, args.lm_head, kernels=args.trainer_kernels
    )
    cfg = model_config(
        args.n_items, args.max_new_tokens, args.n_layer, args.n_head, args.n_embd
    )
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, prec.device)
    llm = start_engine(
        ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32, **more
    )
    return llm, record

def main(argv=None):
    p = argparse.ArgumentParser(description="every RL run of a plan, once, resumable")
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line, exit 2
    p.add_argument("--plan", default="campaign", choices=list(PLANS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--arms", nargs="+", default=None, help="only these arms of the plan")
    p.add_argument(
        "--samples",
        type=int,
        default=8,
        help="held-out samples of each problem (probe.py heldout)",
    )
    p.add_argument(
        "--runs", default=os.path.join("runs", "campaign"), help="where the runs work"
    )
    p.add_argument(
        "--results", default="results", help="where finished runs' small files go, per machine"
    )
    p.add_argument(
        "--list", action="store_true", help="print the plan and what is done, run nothing"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end every run after its N-th update (of --steps' schedule)",
    )
    p.add_argument(
        "--run",
        action="store_true",
        help="one run of train_grpo.py's flags after --, instruments on",
    )
    p.add_argument("--dial", type=int, default=None, help="--run: the dial's dose (dial.py)")
    p.add_argument("--dial-shape", default="uniform", choices=["uniform", "bf16"])
    p.add_argument("--dial-calibration", default=None, help="--run: dial.py calibrate's JSON")
    p.add_argument(
        "extra",
        nargs="*",
        help="after --: more train_grpo.py flags for every run (the tests' small runs)",
    )
    args = p.parse_args(argv)
    if args.samples < 1 or (args.stop_after or 1) < 1:
        p.error(
            f"--samples and --stop-after must be >= 1, got {args.samples} and {args.stop_after}"
        )
    unknown = set(args.arms or []) - {arm for arm, _ in PLANS[args.plan]}
    if unknown:
        p.error(f"--arms: {sorted(unknown)} not in plan {args.plan}")
    if args.run:
        dial = (args.dial, args.dial_shape, args.dial_calibration) if args.dial else None
        return train_run(args.extra, args.stop_after, dial)
    os.chdir(ROOT)
    stopped = (
        [f"step{args.stop_after}"] if args.stop_after else []
    )  # mid-run policies: a folder of their own
    results, args.runs = os.path.join(
        args.results, machine_group(machine()), *stopped
    ), os.path.join(args.runs, *stopped)
    runs = plan_runs(args)
    todo = [(n, f, d) for n, f, d in runs if not finished(os.path.join(results, n))]
    print(
        f"plan {args.plan}: {len(runs)} runs, {len(runs) - len(todo)} done in {results}",
        flush=True,
    )
    if args.list:
        return print(
            "\n".join(f"  {'todo' if (n, f, d) in todo else 'done'}  {n}" for n, f, d in runs)
        )
    os.makedirs(results, exist_ok=True)
    timed = []
    if args.plan == "dial" and not os.path.isfile(os.path.join(results, "dial.json")):
        p.error(f"--plan dial: no {results}/dial.json: run experiments/dial.py calibrate first")
    for i, (name, flags, dial_opts) in enumerate(todo):
        t0 = time.time()
        print(f"[{len(runs) - len(todo) + i + 1}/{len(runs)}] {name}", flush=True)
        if not run_one(name, flags, dial_opts, args, results):
            print(
                f"campaign: {name} failed (its output is above); going on with the next run",
                flush=True,
            )
            continue
        timed.append(time.time() - t0)
        left = (len(todo) - i - 1) * sum(timed) / len(timed)
        print(
            f"[{len(runs) - len(todo) + i + 1}/{len(runs)}] {name} done in {timed[-1]:.0f} s; "
            f"about {left / 3600:.1f} h left at this pace",
            flush=True,
        )

if __name__ == "__main__":
    main()
