"""
experiments/plot.py: the figures and tables, each drawn from files a command wrote, printed as
drawn.

    python experiments/plot.py experiment results/MACHINE --out figures/campaign.png  # RL over seeds, paired
    python experiments/plot.py growth results/MACHINE --out figures/growth.png        # why the mismatch grows
    python experiments/plot.py fixes figures/probe.json figures/campaign.json --out figures/fixes.json

experiment: the run folders ARM-VARIANT-sSEED experiments/campaign.py leaves; per arm and
variant n, mean and s.e. (ddof 1) over seeds of the last-10 reward and the fp32 engine's
held-out accuracy, each paired by seed against bf16 (95 % t interval, exact sign-flip p),
printed as the README's Markdown table. growth: the same runs, why the mismatch grows. fixes:
the fixes side by side, offline and in RL. The numbers drawn go to a JSON beside the PNG."""

import argparse
import itertools
import json
import math
import os
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

def load_experiment(folder):
    """{arm: {variant: [(seed, rows, {the fp32 held-out accuracy, growth's figures})]}} of every
    finished run, and the machine of its runs (one group: pairs across machines are not pairs).
    """
    runs, machines = {}, set()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(path, "args.json")):
            continue
        args = json.load(open(os.path.join(path, "args.json")))
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
        refuse(f"{folder} holds no finished run folder named ARM-VARIANT-sSEED")
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
    runs, where = load_experiment(args.path)
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

def main(argv=None):
    p = argparse.ArgumentParser(
        description="the figures: experiment, growth, fixes (the module docstring)"
    )
    p.error = refuse
    p.add_argument("figure", choices=["experiment", "growth", "fixes"])
    p.add_argument(
        "path",
        help="experiment, growth: a folder of runs; fixes: the JSON of `probe.py mismatch`",
    )
    p.add_argument(
        "experiment_json", nargs="?", help="fixes: the JSON `plot.py experiment` wrote"
    )
    p.add_argument(
        "--out",
        required=True,
        help="the PNG to write, its JSON beside it (fixes: the JSON, a table only)",
    )
    args = p.parse_args(argv)
    if (args.figure == "fixes") != bool(args.experiment_json):
        refuse(
            "fixes takes two JSON files (the probe's, the experiment's); "
            "experiment and growth take one folder"
        )
    if args.figure in ("experiment", "growth") and not os.path.isdir(args.path):
        refuse(f"{args.path} is not a folder of runs")
    {"experiment": experiment, "growth": experiment, "fixes": fixes}[args.figure](args)

if __name__ == "__main__":
    main()
