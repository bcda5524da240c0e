r"""
experiments/dial_figure.py: the mismatch dial's figure and tables: how much mismatch RL
tolerates (campaign.py --plan dial and its sister plans; dial.py).

    AMX=results/intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16
    python experiments/dial_figure.py $AMX --seeds 0 1 2 3 4 --shapes uniform bf16 \
        --out figures/dial-intel-amx.png
    python experiments/dial_figure.py $AMX --seeds 5 6 7 8 9 10 11 12 13 14 --tail 0.90 \
        --out figures/dial-tail-intel-amx.png
    python experiments/dial_figure.py results/amd-epyc-avx2 --arms grpo --shapes uniform \
        --seeds 0 1 2 --out figures/dial-amd-avx2.png

Held-out accuracy and last-10 reward against the dose, per arm and shape, mean +- s.e. and
paired against dose 0; beside them the audit's prediction (audit.py --dial-doses, if its JSON
is in the folder); every chip's bf16 and fp16 and the published figures marked. Then the
practitioner's table (the largest dose with no measurable loss, the dose at a loss of 0.01
and 0.05), every cell's table, and with --tail L each cell's runs below L. --arms: some arms
alone (Holm then over their tests). The numbers drawn go to a JSON beside the PNG. Page:
experiments/dial.md.
"""
import json
import os
import re

import numpy as np

from common import fmt, holm, load, load_json, mean_se, paired, refuse
from plans import PLANS
from variants import DIAL_SHAPES, parse_run
from results import load_experiment, parse_runs, plt, runs_parser, save, variant

DOSE0 = 0.01  # where dose 0 sits on the log axis, in units of the chip's bf16 (it has no log)
LOSSES = (0.01, 0.05)  # the held-out losses the practitioner's table finds the dose of
SEEDS_MARKED = 8  # a chip's marks without a calibration: plan campaign's seeds 0-7
CHIPS = {  # results/ folder: a short name for the marks; a folder not named here has none
    "amd-epyc-avx2": "AMD Zen 3 (AVX2)",
    "amd-epyc-avx2-avx512f-avx512-bf16": "AMD Zen 4/5 (AVX-512-BF16)",
    "intel-xeon-processor-2-80ghz-avx2-avx512f": "Intel Xeon (AVX-512F)",
    "intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16":
        "Intel Xeon (AMX)",
}
# For orientation only, other models and tasks: per-token |log mu - log pi| (nats), as
# converted in experiments/dial.md. (label, low, high)
PUBLISHED = [("Qwen2.5-0.5B bf16 (Fast-LLM #525)", 3.0e-2, 3.0e-2),
             ("Qwen2.5-0.5B fp16 (Fast-LLM #525)", 4.2e-3, 4.2e-3),
             ("Qwen3-0.6B bf16 vs fp32 (HF phantom clipping)", 1e-2, 1e-1)]
COLUMNS = [("heldout", "held-out accuracy", False),
           ("heldout", "held-out, minus dose 0 (95 % CI)", True),
           ("reward_last10", "last-10 reward", False),
           ("reward_last10", "last-10 reward, minus dose 0 (95 % CI)", True)]
AUDIT_KEYS = ("dial_dose", "bias_over_noise", "bias_over_noise_ci", "steps_upper",
              "cos_bias_grad", "bias_norm", "grad_mean_norm", "mismatch_logp_abs_mean")

def chip_marks(results):
    """Each chip's plain bf16 and fp16 mismatch on the warm start: its dial calibration's
    (dial.py calibrate, measured once); where a chip has none, step 0 of its runs of those
    variants in plan campaign's arms at seeds 0-7 (the 0.9M GPT's warm starts, the engine's own
    samples), the mean over runs. The chips named in CHIPS alone, the calibration first, the
    campaign's runs alone: a figure does not move as other runs or another chip's land."""
    marks, campaign = {}, dict(PLANS["campaign"])
    for group in sorted(g for g in os.listdir(results) if g in CHIPS):
        folder, found = os.path.join(results, group), {"bf16": [], "fp16": []}
        calibration = load(os.path.join(folder, "dial.json"))
        if calibration:  # fixed: measured once, on seed 0's warm start
            marks[CHIPS[group]] = {k: {"n": "dial.json", "mean": calibration[key]}
                                   for k, key in (("bf16", "unit"), ("fp16", "fp16"))}
            continue
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            args, parsed = load(os.path.join(folder, name, "args.json")), parse_run(name)
            if not parsed or parsed[0] not in campaign or parsed[2] >= SEEDS_MARKED:
                continue  # the larger GPT's arms, the later seeds: not the marks' runs
            if args and variant(args) in found:
                first = json.loads(open(os.path.join(folder, name, "metrics.jsonl")).readline())
                found[variant(args)].append(first["mismatch_logp_abs_mean"])
        if all(found.values()):
            marks[CHIPS[group]] = {k: {"n": len(x), "mean": float(np.mean(x))}
                                   for k, x in found.items()}
    return marks

def dose_cell(seeds):
    """Per seed: held-out, last-10 reward, the mismatch a token (over the run, at step 0) and
    the share of sequences the clip silenced (the same)."""
    runs = [rows for _, rows, _ in seeds]
    return {"seeds": [s for s, _, _ in seeds], "heldout": [x["heldout"] for _, _, x in seeds],
            "reward_last10": [float(np.mean([r["reward_mean"] for r in rows[-10:]]))
                              for rows in runs],
            "mismatch": [float(np.mean([r["mismatch_logp_abs_mean"] for r in rows]))
                         for rows in runs],
            "mismatch_step0": [rows[0]["mismatch_logp_abs_mean"] for rows in runs],
            "clip_seq_frac": [float(np.mean([r.get("clip_seq_frac", 0.0) for r in rows]))
                              for rows in runs],
            "clip_seq_frac_step0": [rows[0].get("clip_seq_frac", 0.0) for rows in runs]}

def dose_cells(runs):
    """{shape: {arm: {dose: dose_cell}}}, the arms with a dose beyond 0 in that shape."""
    cells = {}
    for arm, by_variant in runs.items():
        for v, seeds in by_variant.items():
            m = re.fullmatch(r"bf16-aligned(?:-dial(\d+)-(\w+))?", v)
            if not m:
                continue
            dose, shapes = (int(m[1]), [m[2]]) if m[1] else (0, DIAL_SHAPES)
            cell = dose_cell(sorted(seeds, key=lambda s: s[0]))
            for shape in shapes:  # dose 0 is both shapes' control: the aligned run itself
                cells.setdefault(shape, {}).setdefault(arm, {})[dose] = cell
    return {shape: {arm: by_dose for arm, by_dose in arms.items() if len(by_dose) > 1}
            for shape, arms in cells.items() if any(len(by_dose) > 1 for by_dose in arms.values())}

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
    """The practitioner's row of one arm: its paired differences against dose 0, the largest
    dose with no measurable loss (every dose up to it: the 95 % interval's upper end >= 0),
    and the dose at each loss in LOSSES, with an interval: where the interval's lower end,
    then its upper end, reach the loss (pointwise, log-linear between doses; None: not
    reached)."""
    base, doses, diffs = by_dose.get(0), [], {}
    for dose in sorted(d for d in by_dose if d):
        both = [s for s in by_dose[dose]["seeds"] if base and s in base["seeds"]]
        if len(both) < 2:
            continue
        values = [[c[key][c["seeds"].index(s)] for s in both] for c in (by_dose[dose], base)]
        diffs[dose] = paired(*values)
        doses.append(dose)
    safe = 0
    for dose in doses:
        if diffs[dose]["ci95"][1] < 0:
            break
        safe = dose
    row = {"paired": {str(d): diffs[d] for d in doses}, "largest_dose_no_loss": safe}
    row["largest_dose_tested"] = doses[-1] if doses else None  # paired with dose 0 at n >= 2
    row["doses_tested"] = doses  # which: a plan may skip doses (the patches run 10x and 100x)
    for loss in LOSSES:
        def at(f):  # dose 0 against itself: 0
            return crossing([0, *doses], [0.0] + [f(diffs[d]) for d in doses], -loss)
        row[f"dose_at_loss_{loss}"] = {"estimate": at(lambda x: x["mean"]),
                                       "ci95": [at(lambda x: x["ci95"][0]),
                                                at(lambda x: x["ci95"][1])]}
    return row

def dial_table(path, seeds, arms, doses=None, shapes=DIAL_SHAPES):
    """The figure's numbers: per shape (of shapes) and arm, the cells by dose and their
    tolerance rows; doses, if given, keeps those doses alone (0 among them for the paired
    rows)."""
    runs, where = load_experiment(path, seeds, arms)
    missing = " ".join(sorted(set(arms or []) - set(runs)))
    if missing:
        refuse(f"--arms: no dial run of {missing} in {path}")
    calibration = load_json(os.path.join(path, "dial.json"), "dial.py calibrate")
    cells = {shape: c for shape, c in dose_cells(runs).items() if shape in shapes}
    if doses is not None:  # a figure held to the cells every seed has run
        cells = {shape: {arm: {d: c for d, c in by_dose.items() if d in doses}
                         for arm, by_dose in arms_.items()}
                 for shape, arms_ in cells.items()}
    if not cells:
        refuse(f"{path} holds no dial run (campaign.py --plan dial) beside its dose 0")
    out = {"machine": where, "unit": calibration["unit"],
           "chips": chip_marks(os.path.dirname(path)), "published": PUBLISHED, "shapes": {}}
    for shape in (s for s in DIAL_SHAPES if s in cells):
        out["shapes"][shape] = {"arms": {}}
        for arm, by_dose in sorted(cells[shape].items()):
            doses = sorted(by_dose)
            out["shapes"][shape]["arms"][arm] = {
                "doses": doses, "cells": {str(d): by_dose[d] for d in doses},
                **{key: tolerance(by_dose, key) for key in ("heldout", "reward_last10")}}
        audit = load(os.path.join(path, f"dial-audit-{shape}.json"))
        if audit:  # the prediction, committed before the runs
            rows = [{k: r.get(k) for k in AUDIT_KEYS} for r in audit["rows"]]
            out["shapes"][shape]["audit"] = rows
    return out

def draw_arm(axes, arm, entry, unit, color, shift, shape):
    """One arm's four panels: the means by dose, and the paired differences against dose 0,
    each dose placed at the mismatch its runs realised at step 0 (the mean over seeds)."""
    n = min(len(c["seeds"]) for c in entry["cells"].values())

    def x(dose):  # dose 0 has no log: DOSE0 x the unit, at the far left
        realised = np.mean(entry["cells"][str(dose)]["mismatch_step0"])
        return realised if dose else DOSE0 * unit

    for ax, (key, label, vs0) in zip(axes, COLUMNS):
        if vs0:
            ds = [int(d) for d in entry[key]["paired"]]
            diff = [entry[key]["paired"][str(d)] for d in ds]
            y = np.array([d["mean"] for d in diff])
            err = np.abs(np.array([d["ci95"] for d in diff]).T - y)
            ax.axhline(0, color="k", lw=0.6)
        else:
            ds = entry["doses"]
            stats = [mean_se([v for v in entry["cells"][str(d)][key] if v is not None]) for d in ds]
            y, err = np.array([m for m, _ in stats]), [se or 0 for _, se in stats]
        ax.errorbar([x(d) * shift for d in ds], y, yerr=err, fmt="o-", ms=4, capsize=3,
                    color=color, label=f"{arm} (n>={n})")
        ax.set_title(f"{shape} noise: {label}", fontsize=9)

def draw_audit(ax, rows, unit, shape):
    """The audit's prediction: |bias| over one step's noise, and over the mean gradient, at
    the mismatch the audit's own samples realised."""
    if rows:
        y = np.array([r["bias_over_noise"] for r in rows])
        ci = np.array([r.get("bias_over_noise_ci") or (v, v) for r, v in zip(rows, y)]).T
        doses = [r["mismatch_logp_abs_mean"] or DOSE0 * unit for r in rows]
        ax.errorbar(doses, y, yerr=np.abs(ci - y), fmt="s-", color="k", capsize=3,
                    label="audit: |bias| / one step's noise")
        signal = [r["bias_norm"] / r["grad_mean_norm"] for r in rows]
        ax.plot(doses, signal, "^-", color="0.5", label="audit: |bias| / |mean gradient|")
        ax.axhline(1, color="k", lw=0.6, ls=":")
        ax.set_yscale("symlog", linthresh=1e-2)  # dose 0's bias is exactly 0
    ax.set_title(f"{shape} noise: the audit's prediction (grpo, before the runs)", fontsize=9)

def draw_marks(ax, chips, unit):
    """Every chip's plain bf16 and fp16 mismatch, the published figures, the dose axis."""
    ax.set_xscale("log")
    ax.set_xlim(DOSE0 * unit / 2, 0.2)  # dose 0 to past the published band
    ax.grid(alpha=0.3)
    for i, (chip, m) in enumerate(chips.items()):
        for dtype, ls in (("bf16", "-"), ("fp16", "--")):  # Dark2: tab10's C0-C9 are the arms'
            ax.axvline(m[dtype]["mean"], color=plt.cm.Dark2(i), ls=ls, lw=1,
                       label=f"{chip} {dtype}")
    for i, (label, low, high) in enumerate(PUBLISHED):
        label = f"other models and tasks: {label}"
        if low == high:
            ax.axvline(low, color="0.4", ls=(0, (1, 1 + i)), lw=1.5, label=label)
        else:
            ax.axvspan(low, high, color="0.5", alpha=0.2, lw=0, label=label)
    ax.set_xlabel("realised |log mu - log pi| a token at step 0 (dose 0: far left)", fontsize=8)
    top = ax.secondary_xaxis("top", functions=(lambda v: v / unit, lambda d: d * unit))
    top.set_xlabel("realised dose (x this chip's bf16)", fontsize=8)

def draw(out):
    shapes, unit = list(out["shapes"]), out["unit"]
    every_arm = sorted({arm for s in shapes for arm in out["shapes"][s]["arms"]})  # a colour each
    fig, axes = plt.subplots(len(shapes), 6, figsize=(25, 4.2 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        for arm, entry in out["shapes"][shape]["arms"].items():
            k = every_arm.index(arm)  # the same colour and offset in every row, side by side
            draw_arm(axes[row], arm, entry, unit, f"C{k}", 1.04**k, shape)
        draw_audit(axes[row, 4], out["shapes"][shape].get("audit"), unit, shape)
        for ax in axes[row, :5]:
            draw_marks(ax, out["chips"], unit)
    for ax in axes[:, 5]:  # the last column: the legend
        ax.axis("off")
    legend = {}  # label: handle, each mark once (every panel draws them)
    for ax in axes[:, :5].flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    axes[0, 5].legend(list(legend.values()), list(legend), fontsize=7, loc="upper left")
    fig.suptitle(f"The mismatch dial on the zero-mismatch trainer; {out['machine']}", fontsize=9)
    return fig

def print_tail(out, level):
    """--tail LEVEL: per cell, each seed's held-out accuracy and how many end below LEVEL. A
    tail (now and then a run that does not recover) is a count of such runs: a mean is blind."""
    out["tail"] = {"level": level, "cells": []}
    print(f"\nheld-out accuracy by seed, and the runs below {level} (marked *)\n")
    print(f"| noise | arm | dose | n | runs below {level} | held-out by seed |")
    print("|---|---|---|---|---|---|")
    for shape, t in out["shapes"].items():
        for arm, e in t["arms"].items():
            for dose in e["doses"]:
                c = e["cells"][str(dose)]
                below = [s for s, v in zip(c["seeds"], c["heldout"]) if v < level]
                out["tail"]["cells"].append({"shape": shape, "arm": arm, "dose": dose,
                                             "n": len(c["seeds"]), "seeds_below": below})
                each = ", ".join(f"s{s} {v:.4f}{'*' if s in below else ''}"
                                 for s, v in zip(c["seeds"], c["heldout"]))
                print(f"| {shape} | {arm} | {dose}x | {len(c['seeds'])} | {len(below)} | {each} |")

def show(d):  # a dose within the doses run, or not reached there
    return "not reached" if d is None else f"{d:.3g}x"

def print_tolerance(out):
    """The practitioner's table: per shape and arm, the largest dose with no measurable loss
    of held-out accuracy and the dose at which it loses LOSSES, each with its interval."""
    print(f"\nthe practitioner's table (held-out accuracy, paired by seed against dose 0; doses "
          f"in x this chip's bf16 = {out['unit']:.2e} a token)\n")
    print("| noise | arm | n | doses run | largest dose with no measurable loss | "
          + " | ".join(f"dose at a loss of {loss} [95 % CI]" for loss in LOSSES) + " |")
    print("|---|---|---|---|---|" + "---|" * len(LOSSES))
    for shape, table in out["shapes"].items():
        for arm, e in table["arms"].items():
            h = e["heldout"]
            if h["largest_dose_tested"] is None:
                continue  # no dose paired with dose 0 at two seeds yet
            cuts = [h[f"dose_at_loss_{loss}"] for loss in LOSSES]
            n = min(len(c["seeds"]) for c in e["cells"].values())
            print(f"| {shape} | {arm} | {n} | {', '.join(map(str, h['doses_tested']))}x | "
                  f"{h['largest_dose_no_loss']}x | "
                  + " | ".join(f"{show(c['estimate'])} [{show(c['ci95'][0])}, {show(c['ci95'][1])}]"
                               for c in cuts) + " |")
    print_doses(out)
    print(f"\n{out['machine']}")

def print_doses(out):
    """Every cell: the mismatch it had (at step 0, the warm start's; over the run), held-out
    accuracy and last-10 reward, each against dose 0 paired by seed [95 % CI], the sign-flip
    p and Holm's p over the table's tests of that column."""
    for key in ("heldout", "reward_last10"):
        tests = [d for t in out["shapes"].values() for e in t["arms"].values()
                 for d in e[key]["paired"].values()]
        for d, p in zip(tests, holm([d["p_sign_flip"] for d in tests])):
            d["p_holm"], d["tests_in_table"] = p, len(tests)
    print("\n| noise | arm | dose | n | mismatch a token, step 0 / over the run | clipped "
          "sequences, step 0 / over the run | held-out | minus dose 0 [95 % CI], p, Holm | "
          "last-10 reward | minus dose 0 [95 % CI], p, Holm |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, t in out["shapes"].items():
        for arm, e in t["arms"].items():
            for dose in e["doses"]:
                c, cells = e["cells"][str(dose)], []
                for key in ("heldout", "reward_last10"):
                    m, se = mean_se(c[key])
                    d = e[key]["paired"].get(str(dose))
                    cells.append(f"{m:.4f} +- {fmt(se, '.4f')}")
                    cells.append(f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}], "
                                 f"{d['p_sign_flip']:.3f}, {d['p_holm']:.3f}" if d else "-")
                size = f"{np.mean(c['mismatch_step0']):.2e} / {np.mean(c['mismatch']):.2e}"
                clip = (f"{np.mean(c['clip_seq_frac_step0']):.3f} / "
                        f"{np.mean(c['clip_seq_frac']):.3f}")
                print(f"| {shape} | {arm} | {dose}x | {len(c['seeds'])} | {size} | {clip} | "
                      + " | ".join(cells) + " |")

def main(argv=None):
    p = runs_parser("the mismatch dial's figure and tables (the docstring); --arms: Holm over "
                    "their tests")
    p.add_argument("--tail", type=float, help="also count, per cell, the runs below this held-out")
    p.add_argument("--shapes", nargs="+", choices=DIAL_SHAPES, default=DIAL_SHAPES,
                   help="these shapes alone (a figure held to the runs it was drawn from)")
    args = parse_runs(p, argv)
    out = dial_table(args.path, args.seeds, args.arms, shapes=args.shapes)
    fig = draw(out)
    print_tolerance(out)
    if args.tail is not None:
        print_tail(out, args.tail)
    save(fig, args.out, out)

if __name__ == "__main__":
    main()
