"""
experiments/plot.py: the figures and tables, each drawn from files a command wrote, printed as
drawn.

    python experiments/plot.py experiment results/MACHINE --out figures/campaign.png  # RL over seeds, paired
    python experiments/plot.py growth results/MACHINE --out figures/growth.png        # why the mismatch grows
    python experiments/plot.py fixes figures/probe.json figures/campaign.json --out figures/fixes.json
    python experiments/plot.py dial results/MACHINE --out figures/dial.png            # the mismatch dial

experiment: the run folders ARM-VARIANT-sSEED experiments/campaign.py leaves; per arm and
variant n, mean and s.e. (ddof 1) over seeds of the last-10 reward and the fp32 engine's
held-out accuracy, each paired by seed against bf16 (95 % t interval, exact sign-flip p),
printed as the README's Markdown table. growth: the same runs, why the mismatch grows. fixes:
the fixes side by side, offline and in RL. dial: held-out accuracy and reward against the dial's
dose (campaign.py --plan dial), paired against dose 0, the audit's prediction beside them, and
the practitioner's table (--tail L: and each cell's runs below L; --arms: some arms alone). The
numbers drawn go to a JSON beside the PNG."""

import argparse
import itertools
import json
import math
import os
import re
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")  # write files, never open a window
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the core, and this folder, from anywhere
from instruments import PI_EDGES, machine_line  # noqa: E402
from model import write_atomic  # noqa: E402
from probe import fmt, t_quantile  # noqa: E402

COLORS = {
    "fp16": "tab:blue",
    "bf16": "tab:red",
    "fp32": "0.35",
    "bf16-head32": "tab:orange",
    "bf16-engine32": "tab:purple",
    "bf16-aligned": "tab:green",
    "warm start": "k",
}
PANELS = [
    ("reward_mean", "training reward"),
    ("eval_accuracy", "held-out accuracy"),
    ("mismatch_logp_abs_mean", "mean |log mu - log pi|"),
    ("clip_frac_neg", "clipped tokens, A < 0"),
    ("clip_frac_pos", "clipped tokens, A > 0"),
]
LOW_PI = PI_EDGES.index(
    0.9
)  # the buckets below pi = 0.9: the sampled tokens the trainer is least sure of
FIXES = [  # variant, the probe's matched (engine, trainer) row, what adopting it changes in the code
    ("bf16", ("bf16", "bf16"), "the baseline"),
    (
        "fp16",
        ("fp16", "fp16"),
        "a flag, --dtype fp16 (the GradScaler, a pass-through elsewhere, turns on)",
    ),
    (
        "bf16-head32",
        ("bf16+head32", "bf16+head32"),
        "6 lines: model.forward's head_dtype, Precision, hf_overrides, the flag",
    ),
    (
        "bf16-engine32",
        ("fp32", "bf16"),
        "3 lines: get_precision's engine dtype, the sync's cast to it, the flag",
    ),
    ("fp32", ("fp32", "fp32"), "a flag, --dtype fp32: no 16-bit rounding on either side"),
    (
        "bf16-aligned",
        ("bf16", "bf16-aligned"),
        "aligned.py: the trainer calls vLLM's CPU ops, backward by hand; CPU only",
    ),
]

def refuse(message):
    print(f"error: {message}", file=sys.stderr)  # one line and exit 2, as train_grpo.py
    sys.exit(2)

def variant(args):
    name = (
        args["dtype"]
        + ("-head32" if args.get("lm_head") == "fp32" else "")
        + ("-aligned" if args.get("trainer_kernels") == "engine" else "")
    )
    if args.get("engine_dtype", args["dtype"]) != args["dtype"]:
        name += f"-engine{args['engine_dtype'][2:]}"
    if args.get("dial_dose"):  # experiments/dial.py's runs
        name += f"-dial{args['dial_dose']}-{args['dial_shape']}"
    return name

def mean_se(x):  # the mean and its standard error (ddof 1; None for one value)
    x = np.asarray(x, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None

def paired(
    a, b
):  # a - b by seed: mean, s.e., 95 % t interval, exact two-sided sign-flip p (all 2^n signs)
    d = np.asarray(a) - np.asarray(b)
    m, se = mean_se(d)
    flips = [
        abs((d * s).mean()) >= abs(m) - 1e-12 for s in itertools.product((1, -1), repeat=len(d))
    ]
    half = t_quantile(len(d) - 1) * se if se is not None else None
    return {
        "n": len(d),
        "mean": m,
        "se": se,
        "ci95": [m - half, m + half] if half is not None else None,
        "p_sign_flip": sum(flips) / len(flips),
    }

def load_experiment(folder, seeds=None):
    """{arm: {variant: [(seed, rows, {the fp32 held-out accuracy, growth's figures})]}} of every
    finished run (of those seeds alone, if given), and the machine of its runs (one group: pairs
    across machines are not pairs).
    """
    runs, machines = {}, set()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(path, "args.json")):
            continue
        args = json.load(open(os.path.join(path, "args.json")))
        if seeds is not None and args["seed"] not in seeds:
            continue  # --seeds: a pre-registered set (the tail's new seeds, or the plan's own)
        rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
        if len(rows) < (args.get("stop_after") or args["steps"]):
            continue  # unfinished (campaign.py --stop-after N: a run ended after its N-th update)
        heldout = os.path.join(path, "heldout.json")
        acc = json.load(open(heldout))["accuracy"] if os.path.isfile(heldout) else None
        probe = os.path.join(
            path, "probe.json"
        )  # campaign.PROBED arms: the policy read by probe.py mismatch --quick
        decompose(rows)
        v, seed = variant(args), args["seed"]
        arm = name[: -len(f"-{v}-s{seed}")] if name.endswith(f"-{v}-s{seed}") else name
        runs.setdefault(arm, {}).setdefault(v, []).append(
            (seed, rows, {"heldout": acc, **growth(rows, load(probe))})
        )
        machines.add(machine_line(args["machine"]))
    if not runs:
        which = f" of seeds {' '.join(map(str, seeds))}" if seeds else ""
        refuse(f"{folder} holds no finished run folder named ARM-VARIANT-sSEED{which}")
    if len(machines) > 1:
        refuse(
            f"{folder} mixes runs of {len(machines)} machines: pairs across machines are not pairs"
        )
    return runs, machines.pop()

def load(path):
    return json.load(open(path)) if os.path.isfile(path) else None

def decompose(rows):
    """Shift-share of the per-token mismatch's change since step 0 over the buckets of pi
    (instruments.PI_EDGES), exact: m_t - m_0 = sum_b (f_bt - f_b0) s_b0 (tokens changing bucket:
    "shift") + sum_b f_bt (s_bt - s_b0) (within a bucket); and per step the sampled tokens the
    trainer is least sure of (pi < 0.9): their share of the tokens, their part of m_t."""
    share = lambda r: np.array(r["pi_bucket_frac"])  # noqa: E731
    size = lambda r: np.nan_to_num(
        np.array(r["pi_bucket_logp_abs_mean"], dtype=float)
    )  # an empty bucket: 0 x 0  # noqa: E731
    for r in rows:
        r["mismatch_shift"] = float(((share(r) - share(rows[0])) * size(rows[0])).sum())
        r["mismatch_within"] = float((share(r) * (size(r) - size(rows[0]))).sum())
        r["low_pi_frac"] = float(share(r)[:LOW_PI].sum())
        low = float((share(r) * size(r))[:LOW_PI].sum())
        r["low_pi_share"] = (
            low / r["mismatch_logp_abs_mean"] if r["mismatch_logp_abs_mean"] else 0.0
        )

def growth(rows, probe):
    """Per run: the last 10 steps over step 0 (a ratio), the rise's two parts (decompose) over step
    0's mismatch, so that growth - 1 = within + shift in every format, and the final policy's
    mismatch on identical tokens in bf16 and fp16 (its probe), with its layer errors."""
    last = lambda k: float(np.mean([r[k] for r in rows[-10:]]))  # noqa: E731
    ratio = lambda k: last(k) / rows[0][k] if rows[0][k] else None  # noqa: E731
    m0 = rows[0]["mismatch_logp_abs_mean"]
    part = lambda k: last(k) / m0 if m0 else None  # noqa: E731
    return {
        "mismatch_growth": ratio("mismatch_logp_abs_mean"),
        "within": part("mismatch_within"),
        "shift": part("mismatch_shift"),
        "length_growth": ratio("response_len_mean"),
        "low_pi_frac_growth": ratio("low_pi_frac"),
        "low_pi_share": last("low_pi_share") if m0 else None,
        "entropy_growth": ratio("entropy_mean"),
        "logit_rms_growth": ratio("logit_rms"),
        **probed(probe),
    }

def probed(probe):
    """A policy's matched bf16 and fp16 mismatch on identical tokens (its own, sampled by the fp32
    engine), the share of those tokens the float32 trainer gives pi < 0.9, and its layer errors
    (None: not probed)."""
    pairs = (
        {r["trainer"]: r for r in probe["paired_rows"] if r["engine"] == r["trainer"]}
        if probe
        else {}
    )
    size = {
        k: pairs[k]["mismatch_logp_abs_mean"] if k in pairs else None for k in ("bf16", "fp16")
    }
    low = sum(pairs["fp32"]["pi_bucket_frac"][:LOW_PI]) if "fp32" in pairs else None
    return {
        "probe_bf16": size["bf16"],
        "probe_fp16": size["fp16"],
        "probe_low_pi_frac": low,
        "layers": probe and probe["layers"],
    }

SUMMARY = (
    ("reward_last10", "last-10 reward", ".4f"),
    ("heldout", "held-out (fp32 engine)", ".4f"),
)
GROWTH = (
    ("mismatch_growth", "per-token mismatch, last 10 steps over step 0", ".2f"),
    ("within", "its rise within buckets of pi, over step 0's mismatch", ".2f"),
    (
        "shift",
        "its rise from tokens changing bucket, the same (growth - 1 = within + shift)",
        ".2f",
    ),
    ("length_growth", "response length, last 10 over step 0", ".2f"),
    (
        "low_pi_frac_growth",
        "sampled tokens with pi < 0.9, their share of all tokens, last 10 over step 0",
        ".2f",
    ),
    ("low_pi_share", "their part of the mean mismatch, last 10 steps", ".2f"),
    ("entropy_growth", "entropy of the sampled tokens, the same", ".2f"),
    ("logit_rms_growth", "RMS of the logits, the same", ".2f"),
    (
        "probe_bf16",
        "the policy's bf16 mismatch on its own samples (its probe, at the run's last step)",
        ".3e",
    ),
    ("probe_fp16", "the same in fp16", ".3e"),
    (
        "probe_low_pi_frac",
        "the probe's tokens with pi < 0.9 (float32 trainer), their share",
        ".4f",
    ),
)
GROWTH_PANELS = [
    ("mismatch_logp_abs_mean", "mean |log mu - log pi|"),
    ("mismatch_within", "its rise within buckets of pi"),
    ("mismatch_shift", "its rise from tokens changing bucket"),
    ("entropy_mean", "entropy of the sampled tokens"),
    ("logit_rms", "RMS of the logits"),
    ("response_len_mean", "response length"),
]

def experiment(args):
    """experiment: the sanity table and the RL curves; growth (#24): why the mismatch grows, the same way."""
    runs, where = load_experiment(args.path, args.seeds)
    out = {"machine": where, "arms": {}}
    panels, summary = (GROWTH_PANELS, GROWTH) if args.figure == "growth" else (PANELS, SUMMARY)
    fig, axes = plt.subplots(
        len(runs), len(panels), figsize=(3.8 * len(panels), 3.1 * len(runs)), squeeze=False
    )
    for row, (arm, by_variant) in enumerate(runs.items()):
        cells = out["arms"][arm] = {}
        for v in sorted(by_variant, key=lambda v: list(COLORS).index(v) if v in COLORS else 99):
            seeds = sorted(by_variant[v], key=lambda s: s[0])
            cell = cells[v] = {"seeds": [s for s, _, _ in seeds], "n": len(seeds), "curves": {}}
            for key in ("heldout", "layers", *(k for k, *_ in GROWTH)):
                cell[key] = [x[key] for _, _, x in seeds]
            cell["eval_before"] = [rows[0].get("eval_accuracy_before") for _, rows, _ in seeds]
            cell["reward_last10"] = [
                float(np.mean([r["reward_mean"] for r in rows[-10:]])) for _, rows, _ in seeds
            ]
            for key in (
                "mismatch_logp_abs_mean",
                "clip_frac_pos",
                "clip_frac_neg",
                "time_step_s",
            ):
                per_seed = [
                    np.mean([r[key] for r in rows if r.get(key) is not None])
                    for _, rows, _ in seeds
                    if any(r.get(key) is not None for r in rows)
                ]
                cell[key] = (
                    mean_se(per_seed)[0] if per_seed else None
                )  # the mean over steps, then over seeds
            for col, (key, label) in enumerate(panels):
                curves = [
                    {r["step"]: r[key] for r in rows if r.get(key) is not None}
                    for _, rows, _ in seeds
                ]
                steps = sorted(set.intersection(*(set(c) for c in curves)))
                if not steps:
                    continue
                y = np.array([[c[t] for t in steps] for c in curves])
                x = np.array(steps) + (
                    1 if key == "eval_accuracy" else 0
                )  # evaluated after step s: s + 1 updates
                se = y.std(0, ddof=1) / math.sqrt(len(y)) if len(y) > 1 else np.zeros(len(x))
                cell["curves"][key] = {
                    "x": x.tolist(),
                    "mean": y.mean(0).tolist(),
                    "se": se.tolist(),
                }
                ax = axes[row, col]
                ax.plot(
                    x,
                    y.mean(0),
                    "o-" if key == "eval_accuracy" else "-",
                    ms=3,
                    lw=1.5,
                    color=COLORS.get(v),
                    label=f"{v} (n={len(y)})",
                )
                ax.fill_between(
                    x, y.mean(0) - se, y.mean(0) + se, color=COLORS.get(v), alpha=0.15, lw=0
                )
                ax.set_title(f"{arm}: {label}", fontsize=9)
                ax.set_yscale("log" if key == "mismatch_logp_abs_mean" else "linear")
                ax.grid(alpha=0.3)
        axes[row, 0].legend(fontsize=7)
        bf16 = cells.get(
            "bf16", {}
        )  # the warm start joins the arms whose policies were probed (campaign.PROBED)
        seeds = (
            bf16["seeds"]
            if args.figure == "growth" and any(bf16.get("probe_bf16") or [])
            else []
        )
        warm = [
            (s, probed(p))
            for s in seeds
            if (p := load(os.path.join(args.path, f"warmstart-s{s}", "probe.json")))
        ]
        if warm:  # the third policy of the cross-probe: the warm start each seed began from
            cells["warm start"] = {
                "seeds": [s for s, _ in warm],
                "n": len(warm),
                **{k: [p[k] for _, p in warm] for k in warm[0][1]},
            }
        for v, cell in cells.items():
            for key, *_ in summary:
                values = [x for x in cell.get(key, []) if x is not None]
                cell[key + "_mean"], cell[key + "_se"] = (
                    mean_se(values) if values else (None, None)
                )
                if v != "bf16" and "bf16" in cells:
                    common = sorted(
                        s
                        for s in set(cell["seeds"]) & set(cells["bf16"]["seeds"])
                        if None not in (pick(cell, key, s), pick(cells["bf16"], key, s))
                    )
                    cell[key + "_minus_bf16"] = (
                        paired(
                            [pick(cell, key, s) for s in common],
                            [pick(cells["bf16"], key, s) for s in common],
                        )
                        if len(common) > 1
                        else None
                    )
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
    fig.suptitle(f"Mean over seeds (line) and its standard error (shade); {where}", fontsize=9)
    print_table(out, summary)
    if args.figure == "growth":
        print_cross(out)
        print_layers(out)
    save(fig, args.out, out)

def pick(cell, key, seed):
    return cell.get(key, [None] * cell["n"])[cell["seeds"].index(seed)]

def print_cross(out):
    """The 2 x 2 cross-probe per seed (#24): the bf16- and fp16-trained policies (and the warm
    start), each probed in bf16 and in fp16; then, paired by seed, how much further the
    bf16-trained policy is from the fp16-trained one in bf16 than in fp16 (a log ratio: > 0 if
    training in bf16 drove the policy to where bf16 rounds worse, 0 if the format only sets the
    scale)."""
    for arm, cells in out["arms"].items():
        pols = [cells.get(v) for v in ("warm start", "bf16", "fp16")]
        seeds = sorted(set.intersection(*(set(c["seeds"]) for c in pols))) if all(pols) else []
        seeds = [
            s
            for s in seeds
            if None not in (pick(c, k, s) for c in pols for k in ("probe_bf16", "probe_fp16"))
        ]  # probed arms
        if not seeds:
            continue
        print(
            f"\n{arm}, cross-probe per seed: bf16 / fp16 mismatch of each policy, "
            "on that policy's own samples\n\n"
            "| seed | warm start | bf16-trained | fp16-trained |\n|---|---|---|---|"
        )
        for s in seeds:
            print(
                f"| {s} | "
                + " | ".join(
                    f"{pick(c, 'probe_bf16', s):.3e} / {pick(c, 'probe_fp16', s):.3e}"
                    for c in pols
                )
                + " |"
            )
        log_ratio = lambda k: [
            math.log(pick(pols[1], k, s) / pick(pols[2], k, s)) for s in seeds
        ]  # noqa: E731
        zero = [0.0] * len(
            seeds
        )  # a log ratio against 0: is the bf16-trained policy further off in that format
        cells["bf16"].update(
            cross_bf16=paired(log_ratio("probe_bf16"), zero),
            cross_fp16=paired(log_ratio("probe_fp16"), zero),
            cross_excess=paired(log_ratio("probe_bf16"), log_ratio("probe_fp16")),
        )
        print()
        for key, what in (
            ("cross_bf16", "in bf16"),
            ("cross_fp16", "in fp16"),
            ("cross_excess", "in bf16 minus the same in fp16"),
        ):
            d = cells["bf16"][key]
            if d["se"] is not None:  # two seeds or more (0 when every seed agrees exactly)
                print(
                    f"log(bf16-trained / fp16-trained) {what}: {d['mean']:+.3f} "
                    f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] p={d['p_sign_flip']:.3f} (n={d['n']})"
                )

def print_layers(out):
    """Where the error enters, mean over the seeds' final policies: RMS(mode - fp32) / RMS(fp32)
    per block, norm, logits."""
    probed = [
        (arm, v, [x for x in cell.get("layers") or [] if x])
        for arm, cells in out["arms"].items()
        for v, cell in cells.items()
    ]
    probed = [(arm, v, layers) for arm, v, layers in probed if layers]
    if not probed:
        return
    blocks = (
        len(probed[0][2][0]["bf16"]) - 2
    )  # the entries are the blocks, then the final norm and the logits
    print(
        "\nwhere the error enters (probe.layer_errors), mean over the probed seeds\n\n"
        "| arm | policy | mode | "
        + " | ".join(f"block {i}" for i in range(blocks))
        + " | norm | logits |\n"
        + "|---" * (blocks + 5)
        + "|"
    )
    for arm, v, layers in probed:
        for mode in ("bf16", "bf16-aligned", "fp16", "fp16-aligned"):
            errs = np.mean([x[mode] for x in layers], axis=0)
            print(
                f"| {arm} | {v} (n={len(layers)}) | {mode} | "
                + " | ".join(f"{e:.2e}" for e in errs)
                + " |"
            )

def holm(ps):
    """Holm's step-down adjustment of m p-values (the family-wise error at the nominal level): the
    i-th smallest times (m - i + 1), made non-decreasing, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [None] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted

def print_table(out, summary):
    """The sanity table: a row per arm, a column per variant; mean +- s.e. (n), and against bf16 the
    paired difference [95 % t interval], the sign-flip p, and Holm's p over every test in the table.
    """
    variants = [v for v in COLORS if any(v in cells for cells in out["arms"].values())]
    for key, label, spec in summary:
        tests = [
            d
            for cells in out["arms"].values()
            for v, c in cells.items()
            if (d := c.get(key + "_minus_bf16"))
        ]
        for d, p in zip(tests, holm([d["p_sign_flip"] for d in tests])):
            d["p_holm"], d["tests_in_table"] = p, len(tests)
        print(
            f"\n{label}: mean +- s.e. over seeds (n); vs bf16 paired by seed: mean [95 % CI], sign-flip p, "
            f"Holm's p over the table's {len(tests)} tests\n"
        )
        print("| arm | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
        for arm, cells in out["arms"].items():
            print(
                f"| {arm} | "
                + " | ".join(
                    describe(cells[v], key, spec) if v in cells else "" for v in variants
                )
                + " |"
            )
    print(f"\n{out['machine']}")

def describe(cell, key, spec):
    n = sum(x is not None for x in cell.get(key, []))  # the seeds with this figure
    d, text = (
        cell.get(key + "_minus_bf16"),
        f"{fmt(cell[key + '_mean'], spec)} +- {fmt(cell[key + '_se'], spec)} ({n})",
    )
    return text + (
        f"<br>{fmt(d['mean'], '+' + spec)} [{fmt(d['ci95'][0], '+' + spec)}, {fmt(d['ci95'][1], '+' + spec)}] "
        f"p={d['p_sign_flip']:.3f} Holm {d['p_holm']:.3f}"
        if d
        else ""
    )

def save(fig, out, data):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out + ".tmp.png", dpi=100)
    os.replace(out + ".tmp.png", out)  # never a half-written PNG
    write_atomic(os.path.splitext(out)[0] + ".json", json.dumps(data, indent=1))
    print(f"written {out} and {os.path.splitext(out)[0]}.json")

def load_json(path, experiment):
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        refuse(f"{path} is not the JSON of `{experiment}` ({type(e).__name__})")

def fixes(args):
    """The side-by-side table of the fixes: the mismatch each leaves on identical tokens (the probe's
    paired rows) against bf16's with its 95 % bootstrap interval, the RL result in each arm paired
    against bf16, what it costs (engine sampling, trainer forward + backward), and how to adopt it.
    """
    result, exp = load_json(args.path, "mismatch"), load_json(
        args.experiment_json, "experiment"
    )
    if (
        machine_line(result["machine"]) != exp["machine"]
    ):  # an offline row and an RL result of two chips are not one fix's
        refuse(f"{args.path} and {args.experiment_json} come from different machines")
    rows = {(r["engine"], r["trainer"]): r for r in result["paired_rows"]}
    speed, cost = result["engine_tokens_per_s"], result["trainer_fwd_bwd_s"]
    table, arms = [], [
        a
        for a in exp["arms"]
        if any(c.get("reward_last10_minus_bf16") for c in exp["arms"][a].values())
    ]
    print(
        f"{'fix':14} {'|log mu - log pi|':>17} {'vs bf16 [95% CI]':>24} "
        + " ".join(f"{a + ': reward vs bf16 [95% CI]':>40}" for a in arms)
        + f" {'engine tok/s':>13} {'trainer':>8}  adopt"
    )
    for v, (engine, trainer), how in FIXES:
        r = rows[engine, trainer]
        entry = {
            "fix": v,
            "mismatch_logp_abs_mean": r["mismatch_logp_abs_mean"],
            "over_bf16": r["over_bf16"],
            "adopt": how,
            "engine_speed_vs_bf16": speed[engine] / speed["bf16"],
            "trainer_time_vs_bf16": cost[trainer] / cost["bf16"],
            "rl": {a: exp["arms"][a].get(v, {}).get("reward_last10_minus_bf16") for a in arms},
        }
        table.append(entry)
        o = entry["over_bf16"]
        cells = [
            (
                f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] n={d['n']}"
                if d
                else "-"
            )
            for d in entry["rl"].values()
        ]
        print(
            f"{v:14} {entry['mismatch_logp_abs_mean']:>17.2e} {o['ratio']:>8.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}] "
            + " ".join(f"{c:>40}" for c in cells)
            + f" {entry['engine_speed_vs_bf16']:>12.2f}x {entry['trainer_time_vs_bf16']:>7.2f}x  {how}"
        )
    write_atomic(args.out, json.dumps({"fixes": table, "machine": result["machine"]}, indent=1))
    print(f"written {args.out}")

# ---------------------------------------------------------------------------------------------------
# The mismatch dial (dial.py, campaign.py --plan dial): how much mismatch RL tolerates

DOSE0 = 0.01  # where dose 0 sits on the log axis, in units of the chip's bf16 (it has no log)
LOSSES = (0.01, 0.05)  # the held-out losses the practitioner's table finds the dose of
CHIPS = {  # results/ folder: a short name for the marks
    "amd-epyc-avx2": "AMD Zen 3 (AVX2)",
    "amd-epyc-avx2-avx512f-avx512-bf16": "AMD Zen 4/5 (AVX-512-BF16)",
    "intel-xeon-processor-2-80ghz-avx2-avx512f": "Intel Xeon (AVX-512F)",
    "intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16": "Intel Xeon (AMX)",
}
# For orientation only, other models and tasks: per-token |log mu - log pi| (nats), as converted
# in experiments/README.md section 9. (label, low, high)
PUBLISHED = [
    ("Qwen2.5-0.5B bf16 (Fast-LLM #525)", 3.0e-2, 3.0e-2),
    ("Qwen2.5-0.5B fp16 (Fast-LLM #525)", 4.2e-3, 4.2e-3),
    ("Qwen3-0.6B bf16 vs fp32 (HF phantom clipping)", 1e-2, 1e-1),
]

def chip_marks(results):
    """Each chip's plain bf16 and fp16 mismatch on the warm start: step 0 of its runs of those
    variants (the warm start's policy, the engine's own samples), the mean over runs; where a chip
    has no such runs, its dial calibration's (dial.py calibrate: the same quantity, seed 0)."""
    marks = {}
    for group in sorted(os.listdir(results)):
        folder, found = os.path.join(results, group), {"bf16": [], "fp16": []}
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            path = os.path.join(folder, name, "args.json")
            v = variant(json.load(open(path))) if os.path.isfile(path) else None
            if v in found:
                first = json.loads(open(os.path.join(folder, name, "metrics.jsonl")).readline())
                found[v].append(first["mismatch_logp_abs_mean"])
        calibration = os.path.join(folder, "dial.json")
        if all(found.values()):
            marks[CHIPS.get(group, group)] = {
                k: {"n": len(x), "mean": float(np.mean(x))} for k, x in found.items()
            }
        elif os.path.isfile(calibration):  # no plain runs there: its calibration measured both
            c = json.load(open(calibration))
            marks[CHIPS.get(group, group)] = {
                k: {"n": "dial.json", "mean": c[key]}
                for k, key in (("bf16", "unit"), ("fp16", "fp16"))
            }
    return marks

def dose_cells(runs):
    """{shape: {arm: {dose: (seeds, held-out, last-10 reward, the run's mean mismatch)}}}."""
    cells = {}
    for arm, by_variant in runs.items():
        for v, seeds in by_variant.items():
            m = re.fullmatch(r"bf16-aligned(?:-dial(\d+)-(\w+))?", v)
            if not m:
                continue
            dose, shapes = (int(m[1]), [m[2]]) if m[1] else (0, ["uniform", "bf16"])
            seeds = sorted(seeds, key=lambda s: s[0])
            cell = {
                "seeds": [s for s, _, _ in seeds],
                "heldout": [x["heldout"] for _, _, x in seeds],
                "reward_last10": [
                    float(np.mean([r["reward_mean"] for r in rows[-10:]]))
                    for _, rows, _ in seeds
                ],
                "mismatch": [  # mean |log mu - log pi|, over the run's steps and at step 0
                    float(np.mean([r["mismatch_logp_abs_mean"] for r in rows]))
                    for _, rows, _ in seeds
                ],
                "mismatch_step0": [rows[0]["mismatch_logp_abs_mean"] for _, rows, _ in seeds],
                "clip_seq_frac": [  # the share of sequences the clip silenced, over the run
                    float(np.mean([r.get("clip_seq_frac", 0.0) for r in rows]))
                    for _, rows, _ in seeds
                ],
                "clip_seq_frac_step0": [
                    rows[0].get("clip_seq_frac", 0.0) for _, rows, _ in seeds
                ],
            }
            for shape in shapes:  # dose 0 is both shapes' control: the aligned run itself
                cells.setdefault(shape, {}).setdefault(arm, {})[dose] = cell
    return {  # the arms with a dose beyond 0 in that shape
        shape: {arm: by_dose for arm, by_dose in arms.items() if len(by_dose) > 1}
        for shape, arms in cells.items()
        if any(len(by_dose) > 1 for by_dose in arms.values())
    }

def crossing(doses, values, level):
    """The first dose where `values` falls to `level` or below, log-linear between doses."""
    for i, (d, v) in enumerate(zip(doses, values)):
        if v <= level:
            if i == 0:
                return d
            d0, v0 = doses[i - 1], values[i - 1]
            t = (v0 - level) / (v0 - v)
            return float(np.exp(np.log(max(d0, DOSE0)) * (1 - t) + np.log(d) * t))
    return None

def tolerance(by_dose, key):
    """The practitioner's row of one arm: its paired differences against dose 0, the largest dose
    with no measurable loss (every dose up to it: the 95 % interval's upper end >= 0), and the
    dose at each loss in LOSSES, with an interval: where the interval's lower end, then its
    upper end, reach the loss (pointwise, log-linear between doses; None: not reached)."""
    base = by_dose.get(0)
    doses, diffs = [], {}
    for dose in sorted(d for d in by_dose if d):
        common = [s for s in by_dose[dose]["seeds"] if base and s in base["seeds"]]
        if len(common) < 2:
            continue
        pick_ = lambda c: [c[key][c["seeds"].index(s)] for s in common]  # noqa: E731
        diffs[dose] = paired(pick_(by_dose[dose]), pick_(base))
        doses.append(dose)
    safe = 0
    for dose in doses:
        if diffs[dose]["ci95"][1] < 0:
            break
        safe = dose
    row = {"paired": {str(d): diffs[d] for d in doses}, "largest_dose_no_loss": safe}
    row["largest_dose_tested"] = doses[-1] if doses else None  # paired with dose 0 at n >= 2
    row["doses_tested"] = doses  # which: a plan may skip doses (the patches run 10x and 100x)
    curve = lambda f: [0.0] + [
        f(diffs[d]) for d in doses
    ]  # dose 0 against itself: 0  # noqa: E731
    for loss in LOSSES:
        at = lambda f: crossing([0, *doses], curve(f), -loss)  # noqa: E731
        row[f"dose_at_loss_{loss}"] = {
            "estimate": at(lambda x: x["mean"]),
            "ci95": [at(lambda x: x["ci95"][0]), at(lambda x: x["ci95"][1])],
        }
    return row

def dial_figure(args):
    """dial: held-out accuracy and last-10 reward against the dose, per arm and shape, mean +- s.e.
    and paired against dose 0; beside them the audit's prediction (probe.py audit --dial-doses, if
    its JSON is in the folder); every chip's bf16 and fp16 and the published figures marked."""
    runs, where = load_experiment(args.path, args.seeds)
    if args.arms:  # a figure of some arms: the others' runs are not read
        missing = " ".join(sorted(set(args.arms) - set(runs)))
        if missing:
            refuse(f"--arms: no dial run of {missing} in {args.path}")
        runs = {arm: runs[arm] for arm in args.arms}
    calibration = load_json(os.path.join(args.path, "dial.json"), "dial.py calibrate")
    unit, cells = calibration["unit"], dose_cells(runs)
    if not cells:
        refuse(f"{args.path} holds no dial run (campaign.py --plan dial) beside its dose 0")
    x = lambda dose: max(dose, DOSE0) * unit  # noqa: E731
    out = {"machine": where, "unit": unit, "chips": chip_marks(os.path.dirname(args.path))}
    out["published"], out["shapes"] = PUBLISHED, {}
    columns = [
        ("heldout", "held-out accuracy", False),
        ("heldout", "held-out, minus dose 0 (95 % CI)", True),
        ("reward_last10", "last-10 reward", False),
        ("reward_last10", "last-10 reward, minus dose 0 (95 % CI)", True),
    ]
    shapes = [s for s in ("uniform", "bf16") if s in cells]
    every_arm = sorted({arm for shape in shapes for arm in cells[shape]})  # one colour an arm
    fig, axes = plt.subplots(len(shapes), 6, figsize=(25, 4.2 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        table = out["shapes"][shape] = {"arms": {}}
        for arm, by_dose in sorted(cells[shape].items()):
            doses = sorted(by_dose)
            entry = table["arms"][arm] = {
                "doses": doses,
                "cells": {str(d): by_dose[d] for d in doses},
                **{key: tolerance(by_dose, key) for key in ("heldout", "reward_last10")},
            }
            k = every_arm.index(arm)  # the same colour and offset in every row
            color, shift = f"C{k}", 1.04**k  # arms side by side at a dose
            for col, (key, label, vs0) in enumerate(columns):
                ax = axes[row, col]
                if vs0:
                    ds = [int(d) for d in entry[key]["paired"]]
                    diff = [entry[key]["paired"][str(d)] for d in ds]
                    y = np.array([d["mean"] for d in diff])
                    err = np.abs(np.array([d["ci95"] for d in diff]).T - y)
                    ax.axhline(0, color="k", lw=0.6)
                else:
                    ds = doses
                    stats = [mean_se([v for v in by_dose[d][key] if v is not None]) for d in ds]
                    y, err = np.array([m for m, _ in stats]), [se or 0 for _, se in stats]
                n = min(len(by_dose[d]["seeds"]) for d in doses)
                ax.errorbar(
                    [x(d) * shift for d in ds],
                    y,
                    yerr=err,
                    fmt="o-",
                    ms=4,
                    capsize=3,
                    color=color,
                    label=f"{arm} (n>={n})",
                )
                ax.set_title(f"{shape} noise: {label}", fontsize=9)
        audit = load(os.path.join(args.path, f"dial-audit-{shape}.json"))
        ax = axes[row, 4]
        if audit:  # the prediction, committed before the runs
            rows = audit["rows"]
            y = np.array([r["bias_over_noise"] for r in rows])
            ci = np.array([r.get("bias_over_noise_ci", (v, v)) for r, v in zip(rows, y)]).T
            ax.errorbar(
                [x(r["dial_dose"]) for r in rows],
                y,
                yerr=np.abs(ci - y),
                fmt="s-",
                color="k",
                capsize=3,
                label="audit: |bias| / one step's noise",
            )
            signal = [r["bias_norm"] / r["grad_mean_norm"] for r in rows]
            ax.plot(
                [x(r["dial_dose"]) for r in rows],
                signal,
                "^-",
                color="0.5",
                label="audit: |bias| / |mean gradient|",
            )
            ax.axhline(1, color="k", lw=0.6, ls=":")
            ax.set_yscale("symlog", linthresh=1e-2)  # dose 0's bias is exactly 0
            table["audit"] = [
                {
                    k: r.get(k)
                    for k in (
                        "dial_dose",
                        "bias_over_noise",
                        "bias_over_noise_ci",
                        "steps_upper",
                        "cos_bias_grad",
                        "bias_norm",
                        "grad_mean_norm",
                        "mismatch_logp_abs_mean",
                    )
                }
                for r in rows
            ]
        ax.set_title(
            f"{shape} noise: the audit's prediction (grpo, before the runs)", fontsize=9
        )
        for ax in axes[row, :5]:
            ax.set_xscale("log")
            ax.set_xlim(DOSE0 * unit / 2, 0.2)  # dose 0 to past the published band
            ax.grid(alpha=0.3)
            for i, (chip, m) in enumerate(out["chips"].items()):
                for dtype, ls in (("bf16", "-"), ("fp16", "--")):
                    ax.axvline(
                        m[dtype]["mean"],
                        color=plt.cm.Dark2(i),  # not tab10's C0-C9: those are the arms'
                        ls=ls,
                        lw=1,
                        label=f"{chip} {dtype}",
                    )
            for i, (label, low, high) in enumerate(PUBLISHED):
                label = f"other models and tasks: {label}"
                if low == high:
                    ax.axvline(low, color="0.4", ls=(0, (1, 1 + i)), lw=1.5, label=label)
                else:
                    ax.axvspan(low, high, color="0.5", alpha=0.2, lw=0, label=label)
            ax.set_xlabel("mean |log mu - log pi| a token (dose 0 at the far left)")
            top = ax.secondary_xaxis("top", functions=(lambda v: v / unit, lambda d: d * unit))
            top.set_xlabel("dose (x this chip's bf16)", fontsize=8)
    for ax in axes[:, 5]:  # the last column: the legend
        ax.axis("off")
    legend = {}  # label: handle, each mark once (every panel draws them)
    for ax in axes[:, :5].flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    axes[0, 5].legend(list(legend.values()), list(legend), fontsize=7, loc="upper left")
    fig.suptitle(f"The mismatch dial on the zero-mismatch trainer; {where}", fontsize=9)
    print_tolerance(out)
    if args.tail is not None:
        print_tail(out, args.tail)
    save(fig, args.out, out)

def print_tail(out, level):
    """--tail LEVEL: per cell, each seed's held-out accuracy and how many end below LEVEL. A tail
    (now and then a run that does not recover) is a count of such runs, where a mean is blind."""
    out["tail"] = {"level": level, "cells": []}
    print(f"\nheld-out accuracy by seed, and the runs below {level} (marked *)\n")
    print(f"| noise | arm | dose | n | runs below {level} | held-out by seed |")
    print("|---|---|---|---|---|---|")
    for shape, t in out["shapes"].items():
        for arm, e in t["arms"].items():
            for dose in e["doses"]:
                c = e["cells"][str(dose)]
                below = [s for s, v in zip(c["seeds"], c["heldout"]) if v < level]
                out["tail"]["cells"].append(
                    {"shape": shape, "arm": arm, "dose": dose, "n": len(c["seeds"]),
                     "seeds_below": below}
                )
                each = ", ".join(
                    f"s{s} {v:.4f}{'*' if s in below else ''}"
                    for s, v in zip(c["seeds"], c["heldout"])
                )
                print(f"| {shape} | {arm} | {dose}x | {len(c['seeds'])} | {len(below)} | {each} |")

def print_tolerance(out):
    """The practitioner's table: per shape and arm, the largest dose with no measurable loss of
    held-out accuracy and the dose at which it loses LOSSES, each with its interval."""
    print(
        f"\nthe practitioner's table (held-out accuracy, paired by seed against dose 0; doses in x "
        f"this chip's bf16 = {out['unit']:.2e} a token)\n"
    )
    print(
        "| noise | arm | n | doses run | largest dose with no measurable loss | "
        + " | ".join(f"dose at a loss of {loss} [95 % CI]" for loss in LOSSES)
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(LOSSES))
    show = lambda d: (
        "not reached" if d is None else f"{d:.3g}x"
    )  # within the doses run  # noqa: E731
    for shape, table in out["shapes"].items():
        for arm, e in table["arms"].items():
            if e["heldout"]["largest_dose_tested"] is None:
                continue  # no dose paired with dose 0 at two seeds yet
            cuts = [e["heldout"][f"dose_at_loss_{loss}"] for loss in LOSSES]
            n = min(len(c["seeds"]) for c in e["cells"].values())
            print(
                f"| {shape} | {arm} | {n} | {', '.join(map(str, e['heldout']['doses_tested']))}x | "
                f"{e['heldout']['largest_dose_no_loss']}x | "
                + " | ".join(
                    f"{show(c['estimate'])} [{show(c['ci95'][0])}, {show(c['ci95'][1])}]"
                    for c in cuts
                )
                + " |"
            )
    print_doses(out)
    print(f"\n{out['machine']}")

def print_doses(out):
    """Every cell: the mismatch it had (at step 0, the warm start's; over the run), held-out
    accuracy and last-10 reward, each against dose 0 paired by seed [95 % CI], the sign-flip p
    and Holm's p over the table's tests of that column."""
    for key in ("heldout", "reward_last10"):
        tests = [
            d
            for t in out["shapes"].values()
            for e in t["arms"].values()
            for d in e[key]["paired"].values()
        ]
        for d, p in zip(tests, holm([d["p_sign_flip"] for d in tests])):
            d["p_holm"], d["tests_in_table"] = p, len(tests)
    print(
        "\n| noise | arm | dose | n | mismatch a token, step 0 / over the run | clipped "
        "sequences, step 0 / over the run | held-out | minus dose 0 [95 % CI], p, Holm | "
        "last-10 reward | minus dose 0 [95 % CI], p, Holm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, t in out["shapes"].items():
        for arm, e in t["arms"].items():
            for dose in e["doses"]:
                c, cells = e["cells"][str(dose)], []
                for key in ("heldout", "reward_last10"):
                    m, se = mean_se(c[key])
                    d = e[key]["paired"].get(str(dose))
                    cells.append(f"{m:.4f} +- {fmt(se, '.4f')}")
                    cells.append(
                        f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}], "
                        f"{d['p_sign_flip']:.3f}, {d['p_holm']:.3f}"
                        if d
                        else "-"
                    )
                size = f"{np.mean(c['mismatch_step0']):.2e} / {np.mean(c['mismatch']):.2e}"
                clip = f"{np.mean(c['clip_seq_frac_step0']):.3f} / {np.mean(c['clip_seq_frac']):.3f}"
                print(
                    f"| {shape} | {arm} | {dose}x | {len(c['seeds'])} | {size} | {clip} | "
                    + " | ".join(cells)
                    + " |"
                )

def main(argv=None):
    p = argparse.ArgumentParser(
        description="the figures: experiment, growth, fixes, dial (the module docstring)"
    )
    p.error = refuse
    p.add_argument("figure", choices=["experiment", "growth", "fixes", "dial"])
    p.add_argument(
        "path",
        help="experiment, growth, dial: a folder of runs; fixes: the JSON of `probe.py mismatch`",
    )
    p.add_argument(
        "experiment_json", nargs="?", help="fixes: the JSON `plot.py experiment` wrote"
    )
    p.add_argument(
        "--out",
        required=True,
        help="the PNG to write, its JSON beside it (fixes: the JSON, a table only)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="experiment, growth, dial: read these seeds' runs alone (default: every seed)",
    )
    p.add_argument(
        "--tail",
        type=float,
        help="dial: also count, per cell, the runs whose held-out accuracy ends below this",
    )
    p.add_argument(
        "--arms", nargs="+", help="dial: draw and tabulate these arms alone (Holm over their tests)"
    )
    args = p.parse_args(argv)
    if (args.tail is not None or args.arms) and args.figure != "dial":
        refuse("--tail and --arms read a dial's runs: dial only")
    if args.figure == "fixes" and args.seeds:
        refuse("--seeds reads a folder of runs: experiment, growth or dial")
    if (args.figure == "fixes") != bool(args.experiment_json):
        refuse(
            "fixes takes two JSON files (the probe's, the experiment's); "
            "experiment, growth and dial take one folder"
        )
    if args.figure in ("experiment", "growth", "dial") and not os.path.isdir(args.path):
        refuse(f"{args.path} is not a folder of runs")
    figures = {
        "experiment": experiment,
        "growth": experiment,
        "fixes": fixes,
        "dial": dial_figure,
    }
    figures[args.figure](args)

if __name__ == "__main__":
    main()
