"""
experiments/sites_audit.py: what GSPO's first update does with each variant's mismatch, beside
its falls. It reads audit.py --loss gspo-engine --variant V's JSONs ($M/sites/audit/V-sS.json,
the loop on sites-audit.md) and the gspo-engine runs of those variants and seeds:

    python experiments/sites_audit.py $M --seeds 0 1 2 3 4 5 6 7 \
        --out figures/sites-audit-intel-amx.png

Per audit (a variant at a seed's warm start): |b| / sigma and its two parts, each over sigma,
from the pairwise estimates (audit.bias_statistics): along E g, b_dot_eg / |E g| (negative: the
step shrinks), and across it, sqrt(b2 - along^2) (the step turns; 0 where the estimate is
negative); the share of sequences the clip dropped; and whether that seed's run fell.
Per variant: the means over the seeds audited (whole seeds only: every variant audited), and
whether it fell in 3 or more of its runs' seeds. sites-audit.md's tests: does |b| / sigma, and
does the part across, rank the variants that fell above those that held (exact p: the share of
the C(n, k) ways to pick k of n whose rank sum is at least the fallen ones'; with the fallen on
top, 1 / C(n, k)), Holm over the two; and within a seed, the share of (fell, held) pairs whose
fallen run has the larger part across, its p from DRAWS permutations of the labels within each
seed (seeded: a Monte Carlo p). Exploratory, added after the audits: Spearman's rho of the part
across with the variants' mean |d| (does it track the size?), and the within-seed test with the
audit's mean |d| in place of the part across. The figure: each audit's parts,
along and across, a dot a run, filled where the run fell. Page: experiments/sites-audit.md.

With --dip: the audits at bf16-trunc's stops after 10 updates, one engine and one policy a seed
($M/sites/audit-step10/, the loop on sites-swap.md), each trainer's |b| / sigma, its parts, its
mean |d| and clipped share, and the trunc and rne6 trainers less the rounding one paired by seed
(exact sign-flip p, Holm over the two of each figure); the figure, a line a seed:

    python experiments/sites_audit.py $M --dip --out figures/sites-audit-dip-intel-amx.png
"""
import glob
import itertools
import math
import os

import matplotlib.pyplot as plt
import numpy as np

from causal import FELL
from common import holm, load_json, machine_line, refuse
from results import COLORS, holm_contrasts, machine_title, parse_runs, runs_parser, save
from sites_figure import read

FELL_OF_8 = 3  # a variant "fell" where at least this many of its runs did (sites-audit.md)
# --dip (sites-swap.md): the audits at bf16-trunc's stops, each trainer against the rounding one
DIP = "audit-step10"
DIP_CONTRASTS = [("bf16-trunc-site-trunc", "bf16-trunc"), ("bf16-trunc-site-rne6", "bf16-trunc")]
DIP_FIGURES = ("bias_over_noise", "along", "across", "mismatch", "clipped_share")
DIP_TITLES = {"bias_over_noise": "|b| / sigma", "along": "along E g / sigma (< 0: shrinks)",
              "across": "across E g / sigma (turns)"}
DRAWS = 20_000  # the within-seed test's permutations
TAB10 = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
         "tab:gray", "tab:olive", "tab:cyan"]

def parts(row):
    """|b| / sigma, and its parts along E g and across it, over sigma."""
    sigma = math.sqrt(row["sigma2"])
    along = row["b_dot_eg"] / math.sqrt(row["eg2"]) if row["eg2"] > 0 else 0.0
    across = math.sqrt(max(row["b2"] - along ** 2, 0.0))
    return {"bias_over_noise": row["bias_over_noise"], "along": along / sigma,
            "across": across / sigma, "clipped_share": row["clipped_share"],
            "mismatch": row["mismatch_logp_abs_mean"], "resolved": row["resolved"]}

def read_audits(path, only=None, folder="audit"):
    """{variant: {seed: parts}}, for the seeds every variant has (whole seeds only; of
    `only`, where given), from $M/sites/<folder>/."""
    audits = {}
    for f in sorted(glob.glob(os.path.join(path, "sites", folder, "*.json"))):
        r = load_json(f, "audit.py --loss gspo-engine --variant V --json F")
        seed = int(os.path.basename(f)[:-5].rsplit("-s", 1)[1])
        if r.get("loss") == "gspo-engine" and r.get("variant") and seed in (only or [seed]):
            audits.setdefault(r["variant"], {})[seed] = parts(r["rows"][0])
    if not audits:
        refuse(f"{path}/sites/{folder}/ holds no audit.py --loss gspo-engine --variant result")
    seeds = sorted(set.intersection(*(set(a) for a in audits.values())))
    return {v: {s: a[s] for s in seeds} for v, a in audits.items()}, seeds

def rank_p(values, fell):
    """P(the fallen ones' rank sum >= observed) over every choice of k of n, ranks by value."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    rank = {i: r for r, i in enumerate(order)}
    seen = sum(rank[i] for i, f in enumerate(fell) if f)
    picks = list(itertools.combinations(range(len(values)), sum(fell)))
    return sum(sum(c) >= seen for c in picks) / len(picks)

def within_seed(runs, rng):
    """runs: [(seed, fell, value)]: the share of same-seed (fell, held) pairs where the fallen
    run's value is larger (ties a half), and its permutation p (labels within seeds)."""
    def share(labels):
        wins = pairs = 0
        for s in {r[0] for r in runs}:
            here = [(f, a) for (seed, _, a), f in zip(runs, labels) if seed == s]
            for (fa, a), (fb, b) in itertools.product(here, here):
                if fa and not fb:
                    pairs, wins = pairs + 1, wins + (a > b) + 0.5 * (a == b)
        return wins / pairs if pairs else None
    labels = [f for _, f, _ in runs]
    seen = share(labels)
    if seen is None:
        return None, None
    by_seed = {s: [i for i, r in enumerate(runs) if r[0] == s] for s in {r[0] for r in runs}}
    hits = 0
    for _ in range(DRAWS):
        perm = list(labels)
        for idx in by_seed.values():
            for i, j in zip(idx, rng.permutation(idx)):
                perm[i] = labels[j]
        hits += share(perm) >= seen
    return seen, (1 + hits) / (1 + DRAWS)

def spearman(x, y):  # the rank correlation (no ties among these floats)
    return float(np.corrcoef(np.argsort(np.argsort(x)), np.argsort(np.argsort(y)))[0, 1])

def per_run(cells, key):  # [(seed, fell, value)] of every audited run with a run to read
    return [(s, p["fell"], p[key]) for c in cells.values() for s, p in c["per_seed"].items()
            if p["fell"] is not None]

def analyse(path, only=None):
    audits, seeds = read_audits(path, only)
    ran = read(path, only)  # --seeds' runs (every seed's without it): its falls over them
    runs = ran["variants"]
    missing = [v for v in audits if v not in runs]
    if missing:
        refuse(f"{path}: no gspo-engine runs of {missing[0]}")
    cells = {}
    for v, by_seed in audits.items():
        fell = dict(zip(runs[v]["seeds"], (h < FELL for h in runs[v]["heldout"])))
        means = {k: float(np.mean([p[k] for p in by_seed.values()]))
                 for k in ("bias_over_noise", "along", "across", "clipped_share", "mismatch")}
        cells[v] = {**means, "fell": sum(fell.values()), "runs": len(fell),
                    "per_seed": {s: {**p, "fell": fell.get(s)} for s, p in by_seed.items()}}
    fallen = [c["fell"] >= FELL_OF_8 for c in cells.values()]
    ps = [rank_p([c[k] for c in cells.values()], fallen) for k in ("bias_over_noise", "across")]
    share, p3 = within_seed(per_run(cells, "across"), np.random.default_rng(0))
    rho = spearman(*([c[k] for c in cells.values()] for k in ("across", "mismatch")))
    size_share, size_p = within_seed(per_run(cells, "mismatch"), np.random.default_rng(0))
    return {"seeds": seeds, "variants": cells, "fell_of_8": FELL_OF_8,
            "exploratory_spearman_across_mismatch": rho,
            "exploratory_within_seed_mismatch": {"share": size_share, "p_monte_carlo": size_p},
            "rank_p": {"bias_over_noise": ps[0], "across": ps[1]}, "holm": holm(ps),
            "within_seed": {"share": share, "p_monte_carlo": p3, "draws": DRAWS},
            "machine": ran["machine"]}

def dip(path, only=None):
    """sites-swap.md's audits in the dip: each trainer's figures at bf16-trunc's stops after 10
    updates (one engine, one policy a seed), and each of DIP_CONTRASTS paired by seed for each
    figure, Holm over a figure's two (|b| / sigma's the prediction's family)."""
    audits, seeds = read_audits(path, only, DIP)
    cells = {v: {"seeds": seeds, **{k: [a[s][k] for s in seeds] for k in DIP_FIGURES}}
             for v, a in audits.items()}
    first = sorted(glob.glob(os.path.join(path, "sites", DIP, "*.json")))[0]
    return {"seeds": seeds, "variants": cells,
            "contrasts": {k: holm_contrasts(cells, DIP_CONTRASTS, k) for k in DIP_FIGURES},
            "machine": machine_line(load_json(first, "audit.py --json F")["machine"])}

def print_dip(out):
    head = " | ".join(DIP_FIGURES)
    print(f"\ngspo-engine's update at bf16-trunc's stops after 10 updates, seeds {out['seeds']}: "
          f"means over them\n\n| variant (the trainer's sites) | {head} |\n"
          + "|---" * (len(DIP_FIGURES) + 1) + "|")
    for v, c in out["variants"].items():
        print(f"| {v} | " + " | ".join(f"{np.mean(c[k]):.4g}" for k in DIP_FIGURES) + " |")
    print("\n| figure | contrast | n | mean [95 % CI] | sign-flip p | Holm (2) |\n"
          "|---|---|---|---|---|---|")
    for k, tests in out["contrasts"].items():
        for t in tests:
            lo, hi = t["ci95"]
            print(f"| {k} | {t['a']} - {t['b']} | {t['n']} | {t['mean']:+.4g} [{lo:+.4g}, "
                  f"{hi:+.4g}] | {t['p_sign_flip']:.4f} | {t['p_holm']:.4f} |")
    print(f"\n{out['machine']}")

def dip_figure(out):
    """Each figure of DIP_FIGURES' first three by trainer, a line a seed."""
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = list(out["variants"])
    for ax, k in zip(axes, DIP_FIGURES):
        values = np.array([out["variants"][v][k] for v in names])  # variants x seeds
        ax.plot(range(len(names)), values, "o-", color="0.5", lw=0.8, ms=4)
        ax.set_xticks(range(len(names)), names, rotation=12, fontsize=7)
        ax.set_title(f"{DIP_TITLES[k]}, a line a seed", fontsize=9)
        ax.grid(alpha=0.3)
    machine_title(fig, out["machine"])
    return fig

def print_read(out):
    print(f"\ngspo-engine's first update, seeds {out['seeds']} (means over them); fell: its runs "
          f"below {FELL} of all its seeds\n")
    print("| variant | fell | mean \\|d\\| | clipped | \\|b\\| / sigma | along / sigma | "
          "across / sigma |\n|---|---|---|---|---|---|---|")
    for v, c in sorted(out["variants"].items(), key=lambda kv: -kv[1]["across"]):
        print(f"| {v} | {c['fell']} of {c['runs']} | {c['mismatch']:.3e} | "
              f"{c['clipped_share']:.4f} | {c['bias_over_noise']:.3f} | {c['along']:+.3f} | "
              f"{c['across']:.3f} |")
    (k1, p1), (k2, p2) = out["rank_p"].items()
    h1, h2 = out["holm"]
    w = out["within_seed"]
    print(f"\nthe fallen variants (at least {out['fell_of_8']} runs fell) ranked by {k1}: exact p "
          f"{p1:.4f} (Holm {h1:.4f}); by {k2}: {p2:.4f} (Holm {h2:.4f})")
    if w["share"] is not None:
        print(f"within a seed, (fell, held) pairs where the fallen run's part across is larger: "
              f"{w['share']:.3f}; Monte Carlo p {w['p_monte_carlo']:.2g} ({w['draws']} draws)")
    size = out["exploratory_within_seed_mismatch"]
    print(f"exploratory, after the audits: Spearman's rho of the part across with the mean |d| "
          f"over the variants, {out['exploratory_spearman_across_mismatch']:+.3f}; the within-seed "
          f"share with the mean |d| in its place, {size['share']:.3f} (Monte Carlo p "
          f"{size['p_monte_carlo']:.2g})")
    print(f"\n{out['machine']}")

def figure(out):
    fig, ax = plt.subplots(figsize=(9, 4.2))
    taken = {COLORS.get(v) for v in out["variants"]}
    free = iter(c for c in TAB10 if c not in taken)  # the site variants have no colour of their own
    for v, c in out["variants"].items():
        color = COLORS.get(v) or next(free, "k")
        for s, p in c["per_seed"].items():
            ax.scatter(p["along"], p["across"], s=36, edgecolors=color,
                       facecolors=color if p["fell"] else "none")
        ax.scatter([], [], color=color, label=f"{v} ({c['fell']} of {c['runs']} fell)")
    ax.axvline(0, color="k", lw=0.6, ls=":")
    ax.set_xlabel("bias along E g / sigma (below 0: the first step shrinks)")
    ax.set_ylabel("bias across E g / sigma (the step turns)")
    ax.set_title("gspo-engine's first update, a dot a run (filled: the run fell)", fontsize=9)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    machine_title(fig, out["machine"])
    return fig

def main(argv=None):
    p = runs_parser("the sites' variants audited at GSPO's first update (the docstring)")
    p.add_argument("--dip", action="store_true",
                   help=f"the audits in $M/sites/{DIP}/ instead (sites-swap.md)")
    args = parse_runs(p, argv)
    if args.dip:
        out = dip(args.path, args.seeds)
        print_dip(out)
        return save(dip_figure(out), args.out, out)
    out = analyse(args.path, args.seeds)
    print_read(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
