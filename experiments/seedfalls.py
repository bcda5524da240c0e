"""
experiments/seedfalls.py: do GSPO's falls go with the seed, and with which half of it? A seed
picks two things in a run: its warm start (warm_start.py, the model RL starts from) and its RL
stream (the task's splits, each step's prompts, the engine's sampling). Read over one folder's
runs of an arm, every variant run at all the given seeds:

1. The falls as a seed x variant table (held-out below causal.FELL), each seed's count of falls.
2. Do they cluster by seed? The spread of the seeds' counts, S = sum over seeds of count^2,
   against its distribution when each variant's falls (their number kept) land on its seeds at
   random, independently of the other variants'; p = (1 + draws with S at least the observed)
   / (1 + DRAWS), DRAWS seeded draws (a Monte Carlo p: its own error about +-2 sqrt(p / DRAWS)).
   The variants share seeds by design (paired), so this asks whether a seed's fragility is
   shared across variants, not whether any variant's falls differ from another's.
3. Per seed, two readings of its start under a control variant (--control): the held-out
   accuracy before RL (eval_accuracy_before) and the step-0 mean |log mu - log pi|; each one's
   Spearman correlation with the seed's count of falls, p the same way over the seeds' order,
   Holm over the two.
4. The crossing (variants.py's warm_seed records): a run from warm start W with the RL stream of
   seed R. A seed is fragile where the crossed records' base (the same record from its own
   warm start) fell. Two groups: a fragile start with a held stream, a held start with a fragile
   stream; each one's falls, and Fisher's exact two-sided p between them. Beside them, each
   crossed run's step-0 mean |d|, nearer (in ratio) its start's own run's or its stream's, and
   the step its batch's reward first fell below FELL (the dip), each seed's own run's beside.
5. The split (init_seed records): a run of seed R whose warm start was trained from seed I's
   initial weights on R's supervised batches. Read as the crossing, I in W's place: a fragile
   init with held batches and stream, a held init with fragile ones. Where two or more bases ran
   the same split starts: do their falls cluster by start (2.'s test, starts in the seeds' place)?

    M=results/intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16
    python experiments/seedfalls.py $M --seeds 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 \
        --out figures/seedfalls-intel-amx.png

The figure: the table of falls (left), then the first crossed base's held-out by start and
stream, and the first split base's by init and seed, the base's own runs on the diagonal.
Pages: experiments/seedfalls.md, seedfalls-amd.md, seedsplit-amd.md.
"""
import math
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np

from causal import FELL
from common import fmt, holm, hypergeometric, refuse
from results import load_experiment, machine_title, parse_runs, runs_parser, save
from variants import VARIANTS

ARM = "gspo-engine"
CONTROL = "bf16-trunc"  # the plain trainer against the truncating library: the seeds' readings
DRAWS = 100_000  # the Monte Carlo p's draws
SEED = 0  # its generator's seed: the JSON is the same on every rerun
BATCH = 10_000  # draws at a time (memory)

def spread(counts):
    """The statistic: the sum of squared per-seed counts (the total fixed, its spread)."""
    return int((np.asarray(counts) ** 2).sum())

def cluster_p(falls, draws=DRAWS, seed=SEED):
    """falls: seeds x variants, booleans. (S, its mean under the null, the draws reaching it,
    the Monte Carlo p):
    each variant's falls put on random seeds, independently of the others'."""
    falls = np.asarray(falls, dtype=bool)
    observed, per_variant = spread(falls.sum(1)), falls.sum(0)
    rng, hits, total = np.random.default_rng(seed), 0, 0.0
    for start in range(0, draws, BATCH):
        n = min(BATCH, draws - start)
        ranks = rng.random((n, *falls.shape)).argsort(1).argsort(1)  # a random order of seeds
        counts = (ranks < per_variant).sum(2)  # each variant's falls on its first k seeds
        s = (counts ** 2).sum(1)
        hits, total = hits + int((s >= observed).sum()), total + float(s.sum())
    return observed, total / draws, hits, (1 + hits) / (1 + draws)

def ranks(x):
    """Ranks from 1, ties given their mean rank."""
    x = np.asarray(x, dtype=float)
    order, r = x.argsort(kind="stable"), np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r

def spearman(x, y, draws=DRAWS, seed=SEED):
    """Spearman's rho (Pearson's on ranks) and its two-sided Monte Carlo p over y's order."""
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    norm = math.sqrt((rx ** 2).sum() * (ry ** 2).sum())
    if norm == 0:  # a constant: no order to read
        return None, None
    rho = float(rx @ ry / norm)
    rng = np.random.default_rng(seed)
    shuffled = np.array([rng.permutation(ry) for _ in range(draws)]) @ rx / norm
    return rho, (1 + int((np.abs(shuffled) >= abs(rho) - 1e-12).sum())) / (1 + draws)

def fisher_two_sided(a, n_a, b, n_b):
    """Fisher's exact two-sided p for a falls of n_a against b of n_b: every table with the same
    margins at most as likely as the observed one (common.hypergeometric: exact)."""
    ways = hypergeometric(a + b, n_a + n_b, n_a)
    return sum(w for w in ways.values() if w <= ways[a]) / sum(ways.values())

def base_of(v):
    """The same record from its own seed's warm start: a crossed or split variant's base, or
    None."""
    own = replace(VARIANTS[v], warm_seed=None, init_seed=None).recorded()
    return next((w for w, r in VARIANTS.items() if r.recorded() == own), None)

def table(found, seeds):
    """Every variant (not crossed) with a finished run at each seed: {variant: [fell by seed]}."""
    falls = {}
    for v, runs in found.items():
        held = {s: f["heldout"] for s, _, f in runs}
        own = VARIANTS[v].warm_seed is None and VARIANTS[v].init_seed is None
        if own and all(held.get(s) is not None for s in seeds):
            falls[v] = [held[s] < FELL for s in seeds]
    return {v: falls[v] for v in VARIANTS if v in falls}  # the records' order

def covariates(found, seeds, counts, control):
    """Each seed's start under the control, and its Spearman with the seed's count of falls."""
    rows = {s: r for s, r, _ in found.get(control, []) if s in seeds}
    if sorted(rows) != sorted(seeds):
        return None
    out = {}
    for key in ("eval_accuracy_before", "mismatch_logp_abs_mean"):
        values = [rows[s][0][key] for s in seeds]
        rho, p = spearman(values, counts)
        out[key] = {"by_seed": values, "spearman": rho, "p": p}
    for r, p_holm in zip(out.values(), holm([r["p"] for r in out.values()])):
        r["p_holm"] = p_holm  # over the two readings
    return {"control": control, **out}

def run_reading(rows, figures):
    """A run's held-out, whether it fell, its step-0 mean |d|, and the first step whose batch's
    reward fell below FELL (its dip; None where none did)."""
    return {"heldout": figures["heldout"], "fell": figures["heldout"] < FELL,
            "step0_abs": rows[0]["mismatch_logp_abs_mean"] if rows else None,
            "dip_step": next((r["step"] for r in rows if r["reward_mean"] < FELL), None)}

def nearer(x, start, stream):
    """Whether a crossed run's step-0 mismatch lies nearer (in ratio) its start's own run's
    or its stream's: "start", "stream", or None where one is missing."""
    if None in (x, start, stream):
        return None
    return "start" if abs(math.log(x / start)) < abs(math.log(x / stream)) else "stream"

# The two crossings: a record's field, the key its runs are read by, and what that seed gives
# the run against what the run's own seed keeps (the groups' names).
CROSSINGS = {"crossing": ("warm_seed", "warm", "start", "stream"),
             "split": ("init_seed", "init", "init", "batches and stream")}

def crossing(found, kind="crossing"):
    """The crossed (or split) runs, by base: each one's other seed (its warm start, or its
    start's initial weights), stream and reading (run_reading), the base's own runs, its fragile
    seeds, the two groups' falls with Fisher's p, and how many runs' step-0 mismatch lies nearer
    the other seed's own run's than their own seed's."""
    field, key, moved, kept = CROSSINGS[kind]
    out = {}
    for v, runs in found.items():
        w = getattr(VARIANTS[v], field)
        if w is None or (base := base_of(v)) not in found:
            continue
        out.setdefault(base, {"runs": []})["runs"] += [
            {key: w, "seed": s, **run_reading(rows, f)} for s, rows, f in runs]
    for base, c in out.items():
        own = {s: run_reading(rows, f) for s, rows, f in found[base]}
        fragile = {s for s, r in own.items() if r["fell"]}
        held = own.keys() - fragile
        c["own"], c["fragile"] = {str(s): r for s, r in sorted(own.items())}, sorted(fragile)
        c["runs"].sort(key=lambda r: (r[key], r["seed"]))
        for r in c["runs"]:
            ends = (own.get(s, {}).get("step0_abs") for s in (r[key], r["seed"]))
            r["step0_nearer"] = nearer(r["step0_abs"], *ends)
        groups = {f"fragile {moved}, held {kept}": [
                      r["fell"] for r in c["runs"] if r[key] in fragile and r["seed"] in held],
                  f"held {moved}, fragile {kept}": [
                      r["fell"] for r in c["runs"] if r[key] in held and r["seed"] in fragile]}
        c["groups"] = {g: [sum(f), len(f)] for g, f in groups.items()}
        (a, n_a), (b, n_b) = c["groups"].values()
        c["p_fisher_two_sided"] = fisher_two_sided(a, n_a, b, n_b) if n_a and n_b else None
        near = [r["step0_nearer"] for r in c["runs"] if r["step0_nearer"]]
        c["step0_nearer_start"] = [near.count("start"), len(near)]
    return {b: out[b] for b in VARIANTS if b in out}  # the records' order, as the figure's

def split_cluster(split):
    """Do the split starts' falls cluster by start, across the bases? Each start (init, seed)
    that every split base ran, a row; each base, a column; the spread test of the seeds' table
    (cluster_p) over it. None with fewer than two bases."""
    if len(split) < 2:
        return None
    fell = {b: {(r["init"], r["seed"]): r["fell"] for r in c["runs"]} for b, c in split.items()}
    starts = sorted(set.intersection(*(set(f) for f in fell.values())))
    matrix = np.array([[fell[b][k] for b in split] for k in starts], dtype=bool)
    s, expected, hits, p = cluster_p(matrix)
    return {"bases": list(split), "starts": [list(k) for k in starts],
            "falls_by_start": [int(c) for c in matrix.sum(1)],
            "falls_by_base": [int(c) for c in matrix.sum(0)], "spread": s,
            "spread_null_mean": expected, "draws": DRAWS, "draws_reaching": hits, "p": p}

def read(path, seeds, arm=ARM, control=CONTROL):
    runs, where = load_experiment(path, None, [arm], dial=False)
    found = runs.get(arm, {})
    falls = table(found, seeds)
    if not falls:
        refuse(f"{path} holds no {arm} variant with a finished run at every seed given")
    matrix = np.array(list(falls.values())).T  # seeds x variants
    counts = [int(c) for c in matrix.sum(1)]
    s, expected, hits, p = cluster_p(matrix)
    return {"machine": where, "arm": arm, "fell_below": FELL, "seeds": seeds, "falls": falls,
            "falls_by_seed": counts,
            "cluster": {"spread": s, "spread_null_mean": expected, "draws": DRAWS,
                        "draws_reaching": hits, "p": p},
            "covariates": covariates(found, seeds, counts, control),
            **(crossed := {kind: crossing(found, kind) for kind in CROSSINGS}),
            "split_cluster": split_cluster(crossed["split"])}

def print_read(out):
    print(f"{out['arm']}: falls (held-out below {out['fell_below']}) by seed, "
          f"{len(out['falls'])} variants\n")
    print("| variant | " + " | ".join(map(str, out["seeds"])) + " | falls |")
    print("|---|" + "---|" * (len(out["seeds"]) + 1))
    for v, f in out["falls"].items():
        print(f"| {v} | " + " | ".join("x" if x else "." for x in f) + f" | {sum(f)} |")
    print("| falls by seed | " + " | ".join(map(str, out["falls_by_seed"])) + " | |")
    c = out["cluster"]
    print(f"\nclustering: spread {c['spread']} against {c['spread_null_mean']:.1f} by chance; "
          f"{c['draws_reaching']} of {c['draws']} draws reach it: p {c['p']:.5f}")
    if cov := out["covariates"]:
        for key in ("eval_accuracy_before", "mismatch_logp_abs_mean"):
            r = cov[key]
            print(f"{cov['control']}'s {key} against the falls by seed: Spearman "
                  f"{r['spearman']:+.3f}, p {r['p']:.4f}, Holm (2) {r['p_holm']:.4f}")
    for kind, (_, key, moved, kept) in CROSSINGS.items():
        for base, c in out[kind].items():
            print_crossing(base, c, key, moved, kept)
    if c := out["split_cluster"]:
        print(f"\nthe split starts' falls by start ({len(c['starts'])} starts that "
              f"{', '.join(c['bases'])} all ran; falls by base {c['falls_by_base']}): "
              f"{c['falls_by_start']}; spread {c['spread']} against {c['spread_null_mean']:.1f} "
              f"by chance, {c['draws_reaching']} of {c['draws']} draws reach it: p {c['p']:.5f}")
    print(f"\n{out['machine']}")

def print_crossing(base, c, key, moved, kept):
    """One base's crossed (or split) runs: the other seed, the run's seed, held-out, step-0
    mean |d| (nearer which seed's own run's: "start" the other's), the dip's step."""
    print(f"\n{base}, its {moved} from another seed (fragile seeds {c['fragile']}): the {moved}'s "
          f"seed, the {kept}'s, held-out, step-0 mean |d| (nearer the {moved}'s own run's: "
          "start, or the stream's), the dip's step")
    for r in c["runs"]:
        print(f"  {r[key]:>2} {r['seed']:>2} {r['heldout']:.4f} {fmt(r['step0_abs'], '.3e')}"
              f" ({r['step0_nearer']}) {r['dip_step']}{' fell' * r['fell']}")
    print("  its own: " + ", ".join(f"{s} {r['heldout']:.4f} {fmt(r['step0_abs'], '.3e')} "
                                    f"{r['dip_step']}" for s, r in c["own"].items()))
    print(f"  step-0 mismatch nearer the {moved}'s: {c['step0_nearer_start'][0]} of "
          f"{c['step0_nearer_start'][1]}")
    for g, (k, n) in c["groups"].items():
        print(f"  {g}: {k} of {n} fell")
    p = c["p_fisher_two_sided"]
    print(f"  Fisher's exact two-sided p {'-' if p is None else format(p, '.4f')}")

def figure(out):
    crossed = [(kind, base, c) for kind in CROSSINGS for base, c in list(out[kind].items())[:1]]
    fig, axes = plt.subplots(1, 1 + len(crossed), figsize=(7 + 5 * len(crossed), 5.5),
                             squeeze=False)
    ax, names = axes[0][0], list(out["falls"])
    ax.imshow(np.array(list(out["falls"].values())), cmap="Greys", vmin=0, vmax=1.6)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xticks(range(len(out["seeds"])), out["seeds"], fontsize=7)
    ax.set_xlabel("seed (dark: the run fell; the count of falls above)")
    top = ax.secondary_xaxis("top")  # the counts as ticks: the title clears them
    top.set_xticks(range(len(out["seeds"])), out["falls_by_seed"], fontsize=7)
    ax.set_title(f"falls by seed: spread p {out['cluster']['p']:.5f}", fontsize=9)
    for ax, (kind, base, c) in zip(axes[0][1:], crossed):
        grid_panel(ax, base, c, *CROSSINGS[kind][1:])
    machine_title(fig, out["machine"])
    return fig

def grid_panel(ax, base, c, key, moved, kept):
    """One base's crossed (or split) runs' held-out by the other seed (rows) and the run's
    seed (columns), the base's own runs on the diagonal."""
    seeds = sorted({r[k] for r in c["runs"] for k in (key, "seed")})  # rows and columns
    grid = np.full((len(seeds), len(seeds)), np.nan)
    cells = [(r[key], r["seed"], r["heldout"]) for r in c["runs"]]
    cells += [(int(s), int(s), r["heldout"]) for s, r in c["own"].items()]  # the base
    for w, s, h in cells:
        if w in seeds and s in seeds:
            grid[seeds.index(w), seeds.index(s)] = h
            ax.text(seeds.index(s), seeds.index(w), f"{h:.2f}", ha="center", va="center",
                    fontsize=7, color="w" if h < FELL else "k")
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1)
    ax.set_xticks(range(len(seeds)), seeds)
    ax.set_yticks(range(len(seeds)), seeds)
    ax.set_xlabel(f"the {kept}'s seed (the run's)")
    ax.set_ylabel(f"the {moved}'s seed")
    ax.set_title(f"{base}, its {moved} from another seed: held-out", fontsize=9)

def main(argv=None):
    p = runs_parser("do GSPO's falls go with the seed, its start or its stream? (docstring)")
    p.add_argument("--arm", default=ARM)
    p.add_argument("--control", default=CONTROL, help="the variant whose start is read by seed")
    args = parse_runs(p, argv)
    if args.control not in VARIANTS:
        refuse(f"--control {args.control}: no such variant (variants.py)")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        refuse("--seeds: give the seeds every variant of the table ran, each once")
    out = read(args.path, args.seeds, args.arm, args.control)
    print_read(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
