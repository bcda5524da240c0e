"""
experiments/startfalls.py: does what a trained start shows at step 0 predict its fall? GSPO's
falls go with the warm start a run begins from (seedfalls.md), and a start's two draws apart
carry none of it (seedsplit-amd.md): each start a fresh draw. Read over one base variant's runs
from distinct starts, its own at each seed and its split runs (init_seed records: a start
trained once, from another seed's init on the run's seed's batches), crossed runs left out (they
reuse a start). Each run's first row, written before its first update (or with --step K its
row after K updates), against whether it fell (held-out below causal.FELL):

| reading | from the step-0 row | of the start |
|---|---|---|
| least_sure | share of the sampled response tokens with pi < 0.9 | where the mismatch sits |
| entropy_mean | mean next-token entropy over them | how peaky |
| reward_mean | the first batch's reward | what it already solves |
| logit_rms | RMS of the logits over them | the scale rounding works at |
| mismatch_logp_abs_mean | mean abs(log mu - log pi) over them | the mismatch it starts at |
| eval_accuracy_before | held-out accuracy before RL (step 0 only) | what it learned |
| mismatch_growth | mean abs(log mu - log pi) at K over step 0's (K > 0 only) | how fast it grows |

Each reading: the fell and held runs' medians; AUC, the chance a fell run's reading exceeds a
held run's (ties count half); the Mann-Whitney rank sum's exact two-sided p (every choice of
which runs fell equally likely, counted exactly, ties at mean ranks); Holm over the six.

    M=results/amd-epyc-avx2-avx512f-avx512-bf16
    python experiments/startfalls.py $M --base bf16-trunc-site-rne6 \
        --seeds 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 --out figures/startfalls-amd-rne6.png

The figure: a panel a reading, each run's value, held runs left and fell runs right (circles
the seeds' own starts, triangles the split ones). Page: experiments/startfalls-amd.md.
--step K: a reading taken before a run's batch reward first dips (seedfalls' dip) is a warning;
one after is the fall itself.
"""
import math
from collections import Counter

import matplotlib.pyplot as plt
import numpy as np

from causal import FELL
from common import fmt, holm, refuse
from results import load_experiment, machine_title, parse_runs, runs_parser, save
from seedfalls import ARM, base_of, ranks, run_reading
from variants import VARIANTS

LEAST_SURE = 2  # pi_bucket_frac's first two buckets: pi in [0, 0.5) and [0.5, 0.9)
ROW_READINGS = ("least_sure", "entropy_mean", "reward_mean", "logit_rms",
                "mismatch_logp_abs_mean")

def readings_at(step):
    """The six readings at a step: the row's five, and the held-out before RL at step 0, later
    the growth of the mismatch since step 0."""
    return ROW_READINGS + ("eval_accuracy_before" if step == 0 else "mismatch_growth",)

def reading(rows, key, step):
    """A reading of a run's row at step (the docstring's table)."""
    row = rows[step]
    if key == "least_sure":
        return float(sum(row["pi_bucket_frac"][:LEAST_SURE]))
    if key == "mismatch_growth":
        return row["mismatch_logp_abs_mean"] / rows[0]["mismatch_logp_abs_mean"]
    return row[key]

def auc(values, fell):
    """The chance a fell run's value exceeds a held run's, ties half (Mann-Whitney's U over
    the pairs)."""
    r, fell = ranks(values), np.asarray(fell, dtype=bool)
    k, m = int(fell.sum()), int((~fell).sum())
    return float((r[fell].sum() - k * (k + 1) / 2) / (k * m))

def rank_sum_p(values, fell):
    """The rank sum's exact two-sided p: the share of all comb(n, k) choices of k runs whose
    rank sum lies at least as far from its mean as the fell runs' does. Mean ranks are halves,
    so the doubled ranks are integers and the count is exact (a 0/1 knapsack over the sums)."""
    doubled = np.rint(2 * ranks(values)).astype(int)
    fell = np.asarray(fell, dtype=bool)
    n, k = len(doubled), int(fell.sum())
    ways = [Counter({0: 1})] + [Counter() for _ in range(k)]  # ways[j][s]: j runs, sum s
    for x in doubled:
        for j in range(k, 0, -1):  # downwards: each run picked at most once
            for s, w in ways[j - 1].items():
                ways[j][s + int(x)] += w
    mean2 = k * int(doubled.sum())  # n x the mean sum, in integers: no rounding
    far = abs(n * int(doubled[fell].sum()) - mean2)
    extreme = sum(w for s, w in ways[k].items() if abs(n * s - mean2) >= far)
    return extreme / math.comb(n, k)

def starts(found, base, seeds, step=0):
    """The base's own runs at seeds and its split runs: each one's init seed, seed, held-out,
    whether it fell, its dip (seedfalls.run_reading) and its readings at step."""
    runs = [(s, s, rows, f) for s, rows, f in found.get(base, []) if s in seeds]
    for v, found_v in found.items():
        if VARIANTS[v].init_seed is not None and base_of(v) == base:
            runs += [(VARIANTS[v].init_seed, s, rows, f) for s, rows, f in found_v]
    if any(len(rows) <= step for _, _, rows, _ in runs):
        refuse(f"--step {step}: a run of {base} has no row after that many updates")
    return [{"init": i, "seed": s, "own": i == s, "heldout": f["heldout"],
             "fell": f["heldout"] < FELL, "dip_step": run_reading(rows, f)["dip_step"],
             **{key: reading(rows, key, step) for key in readings_at(step)}}
            for i, s, rows, f in sorted(runs, key=lambda r: (r[0] != r[1], r[0], r[1]))]

def read(path, base, seeds, arm=ARM, step=0):
    runs, where = load_experiment(path, None, [arm], dial=False)
    found = runs.get(arm, {})
    if base not in found:
        refuse(f"{path} holds no finished {arm}-{base} run")
    got = starts(found, base, seeds, step)
    fell = [r["fell"] for r in got]
    if all(fell) or not any(fell):
        refuse(f"{base}'s runs all fell or all held: no reading to predict")
    out = {}
    for key in readings_at(step):
        values = [r[key] for r in got]
        out[key] = {"fell_median": float(np.median([v for v, f in zip(values, fell) if f])),
                    "held_median": float(np.median([v for v, f in zip(values, fell) if not f])),
                    "auc": auc(values, fell), "p": rank_sum_p(values, fell)}
    for r, p_holm in zip(out.values(), holm([r["p"] for r in out.values()])):
        r["p_holm"] = p_holm  # over the six readings
    dipped = [r for r in got if r["dip_step"] is not None and r["dip_step"] <= step]
    return {"machine": where, "arm": arm, "base": base, "fell_below": FELL, "seeds": seeds,
            "step": step, "dipped_by_step": len(dipped), "n": len(got), "n_fell": sum(fell),
            "n_own": sum(r["own"] for r in got),
            "runs": got, "readings": out}

def print_read(out):
    keys = list(out["readings"])
    print(f"{out['arm']}-{out['base']}: {out['n']} runs from distinct starts ({out['n_own']} the "
          f"seeds' own), {out['n_fell']} fell (held-out below {out['fell_below']}); read at step "
          f"{out['step']}, where {out['dipped_by_step']} had dipped\n")
    print("| init | seed | held-out | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for r in out["runs"]:
        print(f"| {r['init']} | {r['seed']} | {r['heldout']:.4f}{' x' * r['fell']} | "
              + " | ".join(fmt(r[k], ".4g") for k in keys) + " |")
    print("\n| reading | median, fell | median, held | AUC | exact p | Holm (6) |")
    print("|---|---|---|---|---|---|")
    for key, r in out["readings"].items():
        print(f"| {key} | {r['fell_median']:.4g} | {r['held_median']:.4g} | {r['auc']:.3f} | "
              f"{r['p']:.4f} | {r['p_holm']:.4f} |")
    print(f"\n{out['machine']}")

def figure(out):
    fig, axes = plt.subplots(2, 3, figsize=(12, 7))
    rng = np.random.default_rng(0)  # the jitter: the same figure on every rerun
    for ax, key in zip(axes.flat, out["readings"]):
        for own, marker in ((True, "o"), (False, "^")):
            got = [r for r in out["runs"] if r["own"] == own]
            x = [int(r["fell"]) + rng.uniform(-0.12, 0.12) for r in got]
            ax.scatter(x, [r[key] for r in got], marker=marker, s=22,
                       c=["tab:red" if r["fell"] else "tab:green" for r in got])
        r = out["readings"][key]
        ax.set_xticks([0, 1], ["held", "fell"])
        ax.set_xlim(-0.5, 1.5)
        ax.set_title(f"{key}: AUC {r['auc']:.2f}, p {r['p']:.3f}", fontsize=9)
    machine_title(fig, f"{out['base']}, step {out['step']} by outcome (o own start, ^ split); "
                       f"{out['machine']}")
    return fig

def main(argv=None):
    p = runs_parser("does a start's step-0 reading predict its fall? (docstring)")
    p.add_argument("--arm", default=ARM)
    p.add_argument("--base", required=True, help="the variant whose own and split runs are read")
    p.add_argument("--step", type=int, default=0,
                   help="read each run's row after this many updates")
    args = parse_runs(p, argv)
    if args.step < 0:
        refuse(f"--step {args.step}: a count of updates, 0 or more")
    if args.base not in VARIANTS:
        refuse(f"--base {args.base}: no such variant (variants.py)")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        refuse("--seeds: give the seeds of the base's own runs, each once")
    out = read(args.path, args.base, args.seeds, args.arm, args.step)
    print_read(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
