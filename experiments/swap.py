"""
experiments/swap.py: the swap, read. Does a run need the truncating
engine to start its fall, or to stay in its dip? gspo-engine runs
that change the engine's library after SWAP_STEP updates
(variants.SWAPS), beside the runs that keep one library all the way.

    python experiments/campaign.py --plan swap-stops --stop-after 10 --seeds 0 1 2 3 4 5 6 7
    python experiments/campaign.py --plan swap --seeds 0 1 2 3 4 5 6 7
    python experiments/swap.py $M --seeds 0 1 2 3 4 5 6 7 --out figures/swap-intel-amx.png

The same swaps later (variants.LATE_SWAP), read beside the first:

    python experiments/campaign.py --plan swap-stops --stop-after 20 --seeds 0 1 2 3 4 5 6 7
    python experiments/campaign.py --plan swap-late --seeds 0 1 2 3 4 5 6 7
    python experiments/swap.py $M --step 20 --seeds 0 1 2 3 4 5 6 7 \
        --out figures/swap-20-intel-amx.png

The trainer's site rounding swapped instead, the engine kept (variants.SITE_SWAPS, from
bf16-trunc's same stops; page: experiments/sites-swap.md):

    python experiments/campaign.py --plan sites-swap --seeds 0 1 2 3 4 5 6 7
    python experiments/swap.py $M --swaps site --seeds 0 1 2 3 4 5 6 7 \
        --out figures/sites-swap-intel-amx.png

On a chip whose own library truncates, from bf16's stops (--plan swap-stops --variants bf16
--stop-after 10 first), read with --swaps site-own.

Per variant: n, held-out accuracy mean +- s.e. (ddof 1), the runs
that fell (below causal.FELL), and each seed's held-out at the swap
(the stop's, in $M/stepN/). Then contrasts() paired by seed: mean,
95 % t interval, exact sign-flip p, Holm over the four (six with
--step 20: each later swap against the first too). Then the
factor at the swap: on its swap's update, each swapped run's mean
|log mu - log pi| a token over its unswapped twin's (the same
policy, each on its own engine's samples). The figure: the training
reward by update, mean +- s.e. over seeds, a line per variant, and
each run's held-out accuracy. Page: experiments/swap.md.
"""
import math
import os

import matplotlib.pyplot as plt

from causal import FELL, print_contrasts
from common import fmt, mean_se, refuse
from results import (COLORS, curve, holm_contrasts, load_experiment, machine_title,
                     parse_runs, runs_parser, save)
from variants import LATE_SWAP, LIBRARY_SWAPS, SITE_SWAPS, SWAP_STEP, SWAPS

ARM = "gspo-engine"
FIRST = ["bf16-noamx", "bf16-noamx-to-trunc", "bf16-trunc", "bf16-trunc-to-noamx"]
# --swaps: which swaps are read together, and the table's rows at SWAP_STEP. The trainer's
# site rounding swapped in a truncating engine's dip (sites-swap.md) beside its after sides run
# from the start, against the library forced (site) or the chip's own (site-own, without
# AVX-512-BF16); the engine's rescue, or the aligned trainer, a row outside the contrasts.
SITE_ROWS = ["to-site-trunc", "site-trunc", "to-site-rne6", "site-rne6"]
SETS = {"library": (LIBRARY_SWAPS, FIRST),
        "site": ([v for v in SITE_SWAPS if SWAPS[v][0] == "bf16-trunc"],
                 ["bf16-trunc", *(f"bf16-trunc-{r}" for r in SITE_ROWS), "bf16-trunc-to-noamx"]),
        "site-own": ([v for v in SITE_SWAPS if SWAPS[v][0] == "bf16"],
                     ["bf16", *(f"bf16-{r}" for r in SITE_ROWS), "bf16-aligned"])}
# A swap in its own colour, else its before side's: dashed at SWAP_STEP, dotted later
STYLE = {v: (COLORS.get(v) or COLORS[b], "--" if at == SWAP_STEP else ":")
         for v, (b, _, at) in SWAPS.items()}

def at_step(first, step):
    """The swap with the same sides as a first swap, at `step`."""
    sides = SWAPS[first][:2]
    return next(v for v, (b, a, at) in SWAPS.items() if (b, a) == sides and at == step)

def order(step, swaps="library"):
    """The variants read at a swap step: the set's rows, and after
    each first swap its later one (at LATE_SWAP)."""
    later = step != SWAP_STEP
    return [x for v in SETS[swaps][1]
            for x in [v] + ([at_step(v, step)] if v in SWAPS and later else [])]

def contrasts(step, swaps="library"):
    """Each swap against its before side (what the swap changed), then
    against its after side (what the updates before it left); a later
    swap against the first one too (what waiting changed)."""
    first = [v for v in SETS[swaps][0] if SWAPS[v][2] == SWAP_STEP]
    sides = [(at_step(v, step), SWAPS[v][side]) for side in (0, 1) for v in first]
    return sides + [(at_step(v, step), v) for v in first if step != SWAP_STEP]

def at_swap(path, seeds, step, swaps="library"):
    """{variant: {seed: held-out}} of the stops after `step` updates."""
    stops = os.path.join(path, f"step{step}")
    if not os.path.isdir(stops):
        return {}
    runs, _ = load_experiment(stops, seeds, [ARM], dial=False)
    return {v: {s: f["heldout"] for s, _, f in runs[ARM].get(v, [])}
            for v in SETS[swaps][1] if v in runs.get(ARM, {})}

def factor(swapped, twin, step):
    """On update `step`, the swapped run's mean |d| over its twin's, by seed."""
    key, twins = "mismatch_logp_abs_mean", {s: rows for s, rows, _ in twin}
    return {s: rows[step][key] / twins[s][step][key]
            for s, rows, _ in swapped if s in twins}

def cells_of(runs, stops, step, swaps):
    """Per variant: seeds, held-out, falls, the reward curve; the
    held-out at its swap (a swap's before side's stop; else at step)."""
    cells = {}
    for v in (v for v in order(step, swaps) if v in runs):
        seeds = sorted(runs[v], key=lambda r: r[0])
        held = [f["heldout"] for _, _, f in seeds]
        m, se = mean_se(held)
        before, _, at = SWAPS.get(v, (v, v, step))
        before = stops[at].get(before, {})
        cells[v] = {"seeds": [s for s, _, _ in seeds], "heldout": held, "mean": m, "se": se,
                    "fell": sum(h < FELL for h in held),
                    "heldout_at_swap": [before.get(s) for s, _, _ in seeds],
                    "reward": curve(seeds, "reward_mean")}
    return cells

def read(path, seeds, step=SWAP_STEP, swaps="library"):
    """The table, the contrasts (Holm over those present) and the factors."""
    runs, where = load_experiment(path, seeds, [ARM], dial=False)
    runs = runs.get(ARM, {})
    stops = {at: at_swap(path, seeds, at, swaps) for at in {SWAP_STEP, step}}
    cells = cells_of(runs, stops, step, swaps)
    tests = holm_contrasts(cells, contrasts(step, swaps))
    factors = {}
    for v in (v for v in SWAPS if v in order(step, swaps) and v in runs):
        before, _, at = SWAPS[v]
        if before in runs:
            by_seed = factor(runs[v], runs[before], at)
            logs = [math.log(x) for x in by_seed.values()]
            factors[v] = {"by_seed": {str(s): x for s, x in by_seed.items()},
                          "geometric_mean": math.exp(sum(logs) / len(logs))}
    return {"machine": where, "swap_step": step, "fell_below": FELL,
            "variants": cells, "contrasts": tests, "factor_at_swap": factors}

def print_read(out):
    step, first = out["swap_step"], f"after {SWAP_STEP} updates"
    at = first if step == SWAP_STEP else f"the first swaps {first}, the rest after {step}"
    print(f"\n{ARM}: held-out (fp32 engine), mean +- s.e. (n); runs below {FELL}; "
          f"held-out at the swap ({at}), by seed\n")
    print("| variant | held-out | fell | at the swap |\n|---|---|---|---|")
    for v, c in out["variants"].items():
        at = " ".join(fmt(x, ".2f") for x in c["heldout_at_swap"])
        print(f"| {v} | {fmt(c['mean'], '.4f')} +- {fmt(c['se'], '.4f')} ({len(c['seeds'])})"
              f" | {c['fell']} of {len(c['seeds'])} | {at} |")
    if out["contrasts"]:
        print_contrasts(out["contrasts"])  # causal.py's rows, the same columns
    late = f"the swap's update ({SWAP_STEP}; -at{step}: {step})"
    on = f"update {step}" if step == SWAP_STEP else late
    print(f"\nmean |d| on {on}, swapped over unswapped (by seed; geometric mean)")
    for v, f in out["factor_at_swap"].items():
        seeds = " ".join(f"{x:.2f}" for x in f["by_seed"].values())
        print(f"  {v} over {SWAPS[v][0]}: {seeds}; {f['geometric_mean']:.2f}")
    print(f"\n{out['machine']}")

def figure(out):
    """The reward by update, mean +- s.e.; each run's held-out."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    cells, colors = out["variants"], {}  # a line's colour (the cycle's where a record has none)
    for v, c in cells.items():
        color, ls = STYLE.get(v, (COLORS.get(v), "-"))
        x, m, se = (c["reward"][k] for k in ("x", "mean", "se"))
        line, = left.plot(x, m, ls, color=color, label=f"{v} ({len(c['seeds'])})")
        colors[v] = color = line.get_color()
        lo, hi = [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)]
        left.fill_between(x, lo, hi, color=color, alpha=0.15)
    for step in sorted({SWAP_STEP, out["swap_step"]}):
        left.axvline(step - 0.5, color="k", lw=0.6, ls=":")
    steps = "; ".join(f"{s - 1} and {s}" for s in sorted({SWAP_STEP, out["swap_step"]}))
    left.set_xlabel(f"step (the swap: between steps {steps})", fontsize=8)
    left.set_title("training reward, mean +- s.e. over seeds", fontsize=9)
    left.legend(fontsize=7)
    for i, (v, c) in enumerate(cells.items()):
        right.scatter([i] * len(c["heldout"]), c["heldout"], s=18, color=colors[v])
    right.axhline(FELL, color="k", lw=0.6, ls=":")
    right.set_xticks(range(len(cells)), list(cells), rotation=15, fontsize=7)
    right.set_title("held-out accuracy after 40 updates, a dot a run", fontsize=9)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    machine_title(fig, out["machine"])
    return fig

def main(argv=None):
    p = runs_parser("the swap: a library changed after SWAP_STEP updates")
    p.add_argument("--step", type=int, default=SWAP_STEP, choices=[SWAP_STEP, LATE_SWAP],
                   help="read the swaps at this update (variants.LATE_SWAP: beside the first)")
    p.add_argument("--swaps", default="library", choices=list(SETS),
                   help="the engine's library swapped, or the trainer's site rounding")
    args = parse_runs(p, argv)
    if args.arms not in (None, [ARM]):
        refuse(f"--arms: the swap has one arm, {ARM} (variants.SWAPS)")
    if args.swaps != "library" and args.step != SWAP_STEP:
        refuse(f"--swaps {args.swaps}: its swaps are at update {SWAP_STEP} alone, not --step "
               f"{args.step}")
    out = read(args.path, args.seeds, args.step, args.swaps)
    print_read(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
