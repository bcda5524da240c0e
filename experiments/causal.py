"""
experiments/causal.py: the rounding's causal test, read. Plan `rounding`'s runs of one
machine (campaign.py; plans.py) as one table per arm: which variant's runs fell, and the
paired differences that say whether bf16's truncation or its 7 bits did it.

    python experiments/causal.py results/amd-epyc-avx2 --arms gspo-engine \
        --seeds 0 1 2 3 4 5 6 7 --out figures/causal-amd-avx2.png

Per arm and variant: n, the held-out accuracy's mean +- s.e. (ddof 1), the runs that fell
(held-out below FELL); then each contrast of CONTRASTS paired by seed: the mean difference,
its 95 % t interval, the exact sign-flip p, and Holm's p over every contrast in the table;
on a chip with AMX, CONTROL's contrasts too, a family of their own (Holm over them alone).
Prediction 6 (causal.md): in each bf16 run that fell, the mean |log mu - log pi| a token
reached GROWTH x its step-0 value before the reward first dropped below FELL. The figure:
per arm, each run's held-out accuracy by variant, seeds joined across variants (results.py's
curves are campaign_figure.py's). Page: experiments/causal.md.
"""
import matplotlib.pyplot as plt

from common import fmt, holm, mean_se
from plans import PLANS, WITH_AMX_CONTROL
from results import (COLORS, load_experiment, machine_title, paired_seeds, parse_runs,
                     runs_parser, save)

FELL = 0.5  # a run fell: its held-out accuracy below this (the warm start's is ~0.9)
GROWTH = 3.0  # prediction 6's factor
CONTRASTS = [("bf16-aligned", "bf16"), ("fp16", "bf16"), ("bf16-rotary-torch", "bf16"),
             ("fp16", "bf16-aligned"), ("bf16-trunc", "bf16"),
             ("bf16-trunc-aligned", "bf16-trunc")]
# The AMX control (causal.md), chosen before its runs as its own family:
# is it the rounding, or the kernels that -trunc swaps with it?
CONTROL = [("bf16-trunc", "bf16-noamx"), ("bf16-noamx", "bf16")]

def growth_before_fall(rows, with_fall=True):
    """(the step the reward first fell below FELL, the largest mean |d| up to it over step
    0's: None on an aligned run, whose mismatch is 0), or None for a run that never fell.
    with_fall: the fall's own row counted (the batch whose reward dropped); else the rows
    before it alone."""
    fall = next((r["step"] for r in rows if r["reward_mean"] < FELL), None)
    if fall is None:
        return None
    first = rows[0]["mismatch_logp_abs_mean"]
    most = max(r["mismatch_logp_abs_mean"] for r in rows[:fall + with_fall] or rows[:1])
    return fall, most / first if first else None

def arm_table(by_variant, arm="gspo-engine"):
    """Per variant of the arm's in plan rounding (a record other plans ran beside it is not
    read): seeds, held-out, falls, growth; then the contrasts present."""
    cells, planned = {}, dict(PLANS["rounding"]).get(arm, WITH_AMX_CONTROL)
    for v in (v for v in planned if v in by_variant):
        runs = sorted(by_variant[v], key=lambda run: run[0])
        held = [f["heldout"] for _, _, f in runs]
        m, se = mean_se(held)
        cells[v] = {"seeds": [s for s, _, _ in runs], "heldout": held, "mean": m, "se": se,
                    "fell": sum(h < FELL for h in held),
                    "growth_before_fall": [growth_before_fall(rows) for _, rows, _ in runs]}
    def tests(pairs):
        return [{"a": a, "b": b, **d} for a, b in pairs if a in cells and b in cells
                if (d := paired_seeds(cells[a], cells[b], "heldout"))]
    control = tests(CONTROL)  # absent where the chip has no AMX
    return {"variants": cells, "contrasts": tests(CONTRASTS),
            **({"control": control} if control else {})}

def print_contrasts(tests):
    """One family's rows: its Holm set in print_tables."""
    n = tests[0]["tests_in_table"]
    print(f"\n| contrast | n | mean [95 % CI] | sign-flip p | Holm ({n}) |")
    print("|---|---|---|---|---|")
    for t in tests:
        lo, hi = t["ci95"]
        print(f"| {t['a']} - {t['b']} | {t['n']} | {t['mean']:+.4f} [{lo:+.4f}, "
              f"{hi:+.4f}] | {t['p_sign_flip']:.4f} | {t['p_holm']:.4f} |")

def print_tables(out):
    """The tables, Holm over every contrast of a family in every arm
    (set here, in the JSON too)."""
    for family in ("contrasts", "control"):
        tests = [t for arm in out["arms"].values() for t in arm.get(family, [])]
        for t, p in zip(tests, holm([t["p_sign_flip"] for t in tests])):
            t["p_holm"], t["tests_in_table"] = p, len(tests)
    for arm, table in out["arms"].items():
        print(f"\n{arm}: held-out (fp32 engine), mean +- s.e. (n); runs below {FELL}\n")
        print("| variant | held-out | fell |\n|---|---|---|")
        for v, c in table["variants"].items():
            print(f"| {v} | {fmt(c['mean'], '.4f')} +- {fmt(c['se'], '.4f')} "
                  f"({len(c['seeds'])}) | {c['fell']} of {len(c['seeds'])} |")
        for family in ("contrasts", "control"):
            if table.get(family):
                print_contrasts(table[family])
    print(f"\n{out['machine']}")

def figure(out):
    """Per arm: each seed's held-out accuracy across the variants, a line per seed."""
    arms = list(out["arms"])
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 3.6), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        cells = out["arms"][arm]["variants"]
        names = list(cells)
        for seed in sorted({s for c in cells.values() for s in c["seeds"]}):
            xy = [(i, c["heldout"][c["seeds"].index(seed)])
                  for i, c in enumerate(cells.values()) if seed in c["seeds"]]
            ax.plot(*zip(*xy), "-", color="0.8", lw=0.8, zorder=1)
        for i, v in enumerate(names):
            ax.scatter([i] * len(cells[v]["heldout"]), cells[v]["heldout"], s=18,
                       color=COLORS.get(v), zorder=2)
        ax.axhline(FELL, color="k", lw=0.6, ls=":")
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
        ax.set_title(f"{arm}: held-out accuracy, a dot a run", fontsize=9)
        ax.grid(alpha=0.3)
    machine_title(fig, out["machine"])
    return fig

def main(argv=None):
    p = runs_parser("the rounding's causal test: plan rounding's runs of one machine")
    args = parse_runs(p, argv)
    arms = args.arms or ["gspo-engine", "grpo", "drgrpo-mb4"]
    runs, where = load_experiment(args.path, args.seeds, arms, dial=False)
    out = {"machine": where, "fell_below": FELL,
           "arms": {arm: arm_table(runs[arm], arm) for arm in arms if arm in runs}}
    print_tables(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
