"""
experiments/results.py: a results/<machine>/ folder read as tables, for the figures (no
torch). load_experiment reads every finished run ARM-VARIANT-sSEED; arm_cells turns an arm's
runs into one cell per variant (per-seed figures, curves over the steps, paired differences
against bf16); print_table prints the README's Markdown table. campaign_figure.py and
growth.py draw from them, dial_figure.py reads the same runs by dose.

Per cell: n, mean and s.e. (ddof 1) over seeds of the last-10 reward and the fp32 engine's
held-out accuracy (heldout.py), each paired by seed against bf16 (95 % t interval, exact
sign-flip p), and Holm's p over every test in one table.
"""
import json
import math
import os
import textwrap

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from common import (PI_EDGES, fmt, holm, load, machine_line, mean_se, paired, parser, refuse,
                    write_json)
from variants import VARIANTS, parse_run, variant_of

matplotlib.use("Agg")  # write files, never open a window
# Each variant's colour (its record's, variants.py), then the warm start's; the coloured
# variants first in the tables and figures, in the records' order, then the rest
COLORS = {**{v.name: v.color for v in VARIANTS.values() if v.color}, "warm start": "k"}
ORDER = [*COLORS, *(v for v in VARIANTS if v not in COLORS)]
LOW_PI = PI_EDGES.index(0.9)  # the buckets below pi = 0.9: the tokens the trainer is least sure of
SUMMARY = (("reward_last10", "last-10 reward", ".4f"),
           ("heldout", "held-out (fp32 engine)", ".4f"))
GROWTH = (  # growth.py's table; every cell carries these per seed
    ("mismatch_growth", "per-token mismatch, last 10 steps over step 0", ".2f"),
    ("within", "its rise within buckets of pi, over step 0's mismatch", ".2f"),
    ("shift", "its rise from tokens changing bucket, the same (growth - 1 = within + shift)",
     ".2f"),
    ("length_growth", "response length, last 10 over step 0", ".2f"),
    ("low_pi_frac_growth", "sampled tokens with pi < 0.9, their share of all tokens, last 10 "
     "over step 0", ".2f"),
    ("low_pi_share", "their part of the mean mismatch, last 10 steps", ".2f"),
    ("entropy_growth", "entropy of the sampled tokens, the same", ".2f"),
    ("logit_rms_growth", "RMS of the logits, the same", ".2f"),
    ("probe_bf16", "the policy's bf16 mismatch on its own samples (its probe, at the run's last "
     "step)", ".3e"),
    ("probe_fp16", "the same in fp16", ".3e"),
    ("probe_low_pi_frac", "the probe's tokens with pi < 0.9 (float32 trainer), their share", ".4f"))
MEANS = ("mismatch_logp_abs_mean", "clip_frac_pos", "clip_frac_neg", "time_step_s")

def variant(args):
    """A run's variant's name, from the record its args.json holds (variants.variant_of)."""
    v = variant_of(args)
    return v and v.name

def read_run(folder, name):
    """(arm, variant, seed, args) of a run folder; its name parsed (variants.parse_run) and
    its args.json's record the same variant's, or refused in one line: a run is never filed
    under an arm or variant it is not."""
    args = json.load(open(os.path.join(folder, name, "args.json")))
    parsed, recorded = parse_run(name), variant(args)
    if parsed is None or parsed[1].name != recorded or parsed[2] != args["seed"]:
        refuse(f"{folder}/{name}: not ARM-VARIANT-sSEED of a known arm and variant "
               f"(variants.py), or not what its args.json records ({recorded}, seed "
               f"{args['seed']})")
    return parsed[0], recorded, args["seed"], args

def load_experiment(folder, seeds=None, arms=None, dial=True):
    """{arm: {variant: [(seed, rows, {held-out, growth's figures})]}} of every finished run (of
    those seeds and arms alone, if given; without the dial's doses if not dial), and the
    machine of its runs (one group: pairs across machines are not pairs)."""
    runs, machines = {}, set()
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(os.path.join(path, "args.json")):
            continue
        arm, v, seed, args = read_run(folder, name)
        if (seeds is not None and seed not in seeds) or (arms and arm not in arms):
            continue  # --seeds, --arms: a pre-registered set
        if not dial and args.get("dial_dose"):
            continue
        rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
        if len(rows) < (args.get("stop_after") or args["steps"]):
            continue  # unfinished (campaign.py --stop-after N: ended after its N-th update)
        heldout = load(os.path.join(path, "heldout.json"))
        probe = load(os.path.join(path, "probe.json"))  # PROBED arms: mismatch.py --quick
        decompose(rows)
        figures = {"heldout": heldout and heldout["accuracy"], **growth(rows, probe)}
        runs.setdefault(arm, {}).setdefault(v, []).append((seed, rows, figures))
        machines.add(machine_line(args["machine"]))
    if not runs:
        which = f" of seeds {' '.join(map(str, seeds))}" if seeds else ""
        refuse(f"{folder} holds no finished run folder named ARM-VARIANT-sSEED{which}")
    if len(machines) > 1:
        refuse(f"{folder} mixes runs of {len(machines)} machines: pairs across machines are "
               "not pairs")
    return runs, machines.pop()

def decompose(rows):
    """Shift-share of the per-token mismatch's change since step 0 over the buckets of pi
    (PI_EDGES), exact: m_t - m_0 = sum_b (f_bt - f_b0) s_b0 (tokens changing bucket: "shift")
    + sum_b f_bt (s_bt - s_b0) (within a bucket); and per step the sampled tokens the trainer
    is least sure of (pi < 0.9): their share of the tokens, their part of m_t."""
    def share(r):
        return np.array(r["pi_bucket_frac"])

    def size(r):  # an empty bucket: 0 x 0
        return np.nan_to_num(np.array(r["pi_bucket_logp_abs_mean"], dtype=float))

    for r in rows:
        r["mismatch_shift"] = float(((share(r) - share(rows[0])) * size(rows[0])).sum())
        r["mismatch_within"] = float((share(r) * (size(r) - size(rows[0]))).sum())
        r["low_pi_frac"] = float(share(r)[:LOW_PI].sum())
        low = float((share(r) * size(r))[:LOW_PI].sum())
        m = r["mismatch_logp_abs_mean"]
        r["low_pi_share"] = low / m if m else 0.0

def growth(rows, probe):
    """Per run: the last 10 steps over step 0 (a ratio), the rise's two parts (decompose) over
    step 0's mismatch, so that growth - 1 = within + shift in every format, and the final
    policy's mismatch on identical tokens in bf16 and fp16 (its probe), with its layer errors."""
    def last(k):
        return float(np.mean([r[k] for r in rows[-10:]]))

    def ratio(k):
        return last(k) / rows[0][k] if rows[0][k] else None

    m0 = rows[0]["mismatch_logp_abs_mean"]
    part = (lambda k: last(k) / m0) if m0 else (lambda k: None)
    return {"mismatch_growth": ratio("mismatch_logp_abs_mean"), "within": part("mismatch_within"),
            "shift": part("mismatch_shift"), "length_growth": ratio("response_len_mean"),
            "low_pi_frac_growth": ratio("low_pi_frac"),
            "low_pi_share": last("low_pi_share") if m0 else None,
            "entropy_growth": ratio("entropy_mean"), "logit_rms_growth": ratio("logit_rms"),
            **probe_figures(probe)}

def probe_figures(probe):
    """A policy's matched bf16 and fp16 mismatch on identical tokens (its own, sampled by the
    fp32 engine), the share of those tokens the float32 trainer gives pi < 0.9, and its layer
    errors (None: not probed)."""
    rows = probe["paired_rows"] if probe else []
    pairs = {r["trainer"]: r for r in rows if r["engine"] == r["trainer"]}
    size = {k: pairs[k]["mismatch_logp_abs_mean"] if k in pairs else None for k in ("bf16", "fp16")}
    low = sum(pairs["fp32"]["pi_bucket_frac"][:LOW_PI]) if "fp32" in pairs else None
    return {"probe_bf16": size["bf16"], "probe_fp16": size["fp16"], "probe_low_pi_frac": low,
            "layers": probe and probe["layers"]}

def curve(seeds, key):
    """A metric over the steps every seed has: {x, mean, se}, or None."""
    curves = [{r["step"]: r[key] for r in rows if r.get(key) is not None} for _, rows, _ in seeds]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return None
    y = np.array([[c[t] for t in steps] for c in curves])
    x = np.array(steps) + (1 if key == "eval_accuracy" else 0)  # after step s: s + 1 updates
    se = y.std(0, ddof=1) / math.sqrt(len(y)) if len(y) > 1 else np.zeros(len(x))
    return {"x": x.tolist(), "mean": y.mean(0).tolist(), "se": se.tolist()}

def cell_of(seeds, panels):
    """One variant's cell: its seeds, per-seed figures, means over steps, the panels' curves."""
    seeds = sorted(seeds, key=lambda s: s[0])
    cell = {"seeds": [s for s, _, _ in seeds], "n": len(seeds), "curves": {}}
    for key in ("heldout", "layers", *(k for k, *_ in GROWTH)):
        cell[key] = [x[key] for _, _, x in seeds]
    cell["eval_before"] = [rows[0].get("eval_accuracy_before") for _, rows, _ in seeds]
    cell["reward_last10"] = [float(np.mean([r["reward_mean"] for r in rows[-10:]]))
                             for _, rows, _ in seeds]
    for key in MEANS:  # the mean over steps, then over seeds
        per_seed = [np.mean([r[key] for r in rows if r.get(key) is not None])
                    for _, rows, _ in seeds if any(r.get(key) is not None for r in rows)]
        cell[key] = mean_se(per_seed)[0] if per_seed else None
    for key, _ in panels:
        if (c := curve(seeds, key)) is not None:
            cell["curves"][key] = c
    return cell

def warm_cell(folder, bf16):
    """The third policy of the cross-probe: the warm start each probed seed began from."""
    seeds = bf16["seeds"] if any(bf16.get("probe_bf16") or []) else []
    warm = [(s, probe_figures(p)) for s in seeds
            if (p := load(os.path.join(folder, f"warmstart-s{s}", "probe.json")))]
    if not warm:
        return None
    return {"seeds": [s for s, _ in warm], "n": len(warm),
            **{k: [p[k] for _, p in warm] for k in warm[0][1]}}

def pick(cell, key, seed):
    return cell.get(key, [None] * cell["n"])[cell["seeds"].index(seed)]

def paired_seeds(a, b, key):
    """a's `key` minus b's over the seeds both cells have (results.py's and the dial's
    cells: "seeds" and a value per seed), paired; None under two seeds."""
    both = sorted(set(a["seeds"]) & set(b["seeds"]))
    if len(both) < 2:
        return None
    values = [[c[key][c["seeds"].index(s)] for s in both] for c in (a, b)]
    return {"seeds": both, **paired(*values)}

def holm_contrasts(cells, pairs, key="heldout"):
    """Each (a, b) of pairs with both cells present: a minus b paired by seed (paired_seeds),
    and Holm's p over those present, one table's family."""
    tests = [{"a": a, "b": b, **d} for a, b in pairs if a in cells and b in cells
             if (d := paired_seeds(cells[a], cells[b], key))]
    for t, p in zip(tests, holm([t["p_sign_flip"] for t in tests])):
        t["p_holm"], t["tests_in_table"] = p, len(tests)
    return tests

def summarize(cells, summary):
    """Each cell's mean and s.e. of the summary's figures, and each minus bf16 by seed."""
    for v, cell in cells.items():
        for key, *_ in summary:
            values = [x for x in cell.get(key, []) if x is not None]
            cell[key + "_mean"], cell[key + "_se"] = mean_se(values) if values else (None, None)
            if v == "bf16" or "bf16" not in cells:
                continue
            base = cells["bf16"]
            both = sorted(s for s in set(cell["seeds"]) & set(base["seeds"])
                          if None not in (pick(cell, key, s), pick(base, key, s)))
            values = [[pick(c, key, s) for s in both] for c in (cell, base)]
            cell[key + "_minus_bf16"] = paired(*values) if len(both) > 1 else None

def arm_cells(folder, by_variant, panels, summary, with_warm):
    """An arm's cells, the coloured variants first in the records' order, then the rest as
    found (then the warm start, if asked)."""
    order = sorted(by_variant, key=lambda v: list(COLORS).index(v) if v in COLORS else 99)
    cells = {v: cell_of(by_variant[v], panels) for v in order}
    warm = warm_cell(folder, cells.get("bf16", {})) if with_warm else None
    if warm:
        cells["warm start"] = warm
    summarize(cells, summary)
    return cells

def draw_arm(axes, arm, cells, panels):
    """One row of panels: per variant its curve, mean over seeds and its s.e. shaded."""
    for v, cell in cells.items():
        for ax, (key, label) in zip(axes, panels):
            c = cell.get("curves", {}).get(key)
            if c is None:
                continue
            x, m, se = (np.array(c[k]) for k in ("x", "mean", "se"))
            style = "o-" if key == "eval_accuracy" else "-"
            ax.plot(x, m, style, ms=3, lw=1.5, color=COLORS.get(v), label=f"{v} (n={cell['n']})")
            ax.fill_between(x, m - se, m + se, color=COLORS.get(v), alpha=0.15, lw=0)
            ax.set_title(f"{arm}: {label}", fontsize=9)
            ax.set_yscale("log" if key == "mismatch_logp_abs_mean" else "linear")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)

def draw(path, seeds, arms, panels, summary, with_warm, variants=None):
    """The campaign's runs of a folder (no dial doses; of those variants alone, if given): (a
    row of panels per arm, the table)."""
    runs, where = load_experiment(path, seeds, arms, dial=False)
    if variants:  # a figure held to the runs it was drawn from, as runs of other plans land
        runs = {arm: {v: x for v, x in by_v.items() if v in variants}
                for arm, by_v in runs.items()}
    table = {"machine": where, "arms": {}}
    size = (3.8 * len(panels), 3.1 * len(runs))
    fig, axes = plt.subplots(len(runs), len(panels), figsize=size, squeeze=False)
    for row, (arm, by_variant) in enumerate(runs.items()):
        table["arms"][arm] = arm_cells(path, by_variant, panels, summary, with_warm)
        draw_arm(axes[row], arm, table["arms"][arm], panels)
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
    fig.suptitle(f"Mean over seeds (line) and its standard error (shade); {where}", fontsize=9)
    return fig, table

def runs_parser(description):
    """The flags of a figure drawn from a folder of runs."""
    p = parser(description)
    p.add_argument("path", help="a folder of runs: results/<machine>")
    p.add_argument("--out", required=True, help="the PNG; its JSON beside it")
    p.add_argument("--seeds", type=int, nargs="+", help="these seeds' runs alone")
    p.add_argument("--arms", nargs="+", help="these arms alone")
    return p

def with_variants(p):
    """--variants, for a figure of a campaign's columns (campaign_figure.py, growth.py)."""
    p.add_argument("--variants", nargs="+", help="these variants alone (the table's columns)")
    return p

def parse_runs(p, argv):
    args = p.parse_args(argv)
    if not os.path.isdir(args.path):
        refuse(f"{args.path} is not a folder of runs")
    return args

def describe(cell, key, spec):
    n = sum(x is not None for x in cell.get(key, []))  # the seeds with this figure
    text = f"{fmt(cell[key + '_mean'], spec)} +- {fmt(cell[key + '_se'], spec)} ({n})"
    d = cell.get(key + "_minus_bf16")
    if not d:
        return text
    s = "+" + spec
    return (text + f"<br>{fmt(d['mean'], s)} [{fmt(d['ci95'][0], s)}, {fmt(d['ci95'][1], s)}] "
            f"p={d['p_sign_flip']:.3f} Holm {d['p_holm']:.3f}")

def print_table(out, summary):
    """The sanity table: a row per arm, a column per variant; mean +- s.e. (n), and against
    bf16 the paired difference [95 % t interval], the sign-flip p, and Holm's p over every
    test in the table."""
    variants = [v for v in ORDER if any(v in cells for cells in out["arms"].values())]
    for key, label, spec in summary:
        tests = [d for cells in out["arms"].values() for c in cells.values()
                 if (d := c.get(key + "_minus_bf16"))]
        for d, p in zip(tests, holm([d["p_sign_flip"] for d in tests])):
            d["p_holm"], d["tests_in_table"] = p, len(tests)
        print(f"\n{label}: mean +- s.e. over seeds (n); vs bf16 paired by seed: mean [95 % CI], "
              f"sign-flip p, Holm's p over the table's {len(tests)} tests\n")
        print("| arm | " + " | ".join(variants) + " |\n|---|" + "---|" * len(variants))
        for arm, cells in out["arms"].items():
            row = [describe(cells[v], key, spec) if v in cells else "" for v in variants]
            print(f"| {arm} | " + " | ".join(row) + " |")
    print(f"\n{out['machine']}")

def machine_title(fig, line, fontsize=8):
    """The machine line over the figure, wrapped to the figure's width: a long CPU name
    (ISA flags and all) is not cut at the edges."""
    fits = int(fig.get_figwidth() * 72 / (0.6 * fontsize))  # characters: ~0.6 em each
    fig.suptitle("\n".join(textwrap.wrap(line, fits)), fontsize=fontsize)

def save(fig, out, data):
    """The PNG (atomically) and its numbers in a JSON beside it."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out + ".tmp.png", dpi=100)
    os.replace(out + ".tmp.png", out)  # never a half-written PNG
    write_json(os.path.splitext(out)[0] + ".json", data)
    print(f"written {out} and {os.path.splitext(out)[0]}.json")
