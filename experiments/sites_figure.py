"""
experiments/sites_figure.py: size or sign, read. The trainer rounds to bf16 at the rotary and
attention outputs in another mode (sites.py, variants.py's site_rounding): which of truncation's
two changes, its sign or its size, makes GSPO on the engine's pi_old fall?

First the matched-size check, before any run (anatomy.py on seed 0's warm start, the same
tokens, each mode of the trainer against the chip's rounding engine and a truncating one):

    for m in rne trunc away rne6 sym; do
      python experiments/anatomy.py --hide-amx --site-rounding $m --json $M/sites/noamx-$m.json
      python experiments/anatomy.py --library _C_AVX512 --site-rounding $m \
          --json $M/sites/trunc-$m.json
    done
    python experiments/sites_figure.py $M --matched --out figures/sites-matched-intel-amx.json

Then the runs and their table and figure:

    nohup python experiments/campaign.py --plan sites --seeds 0 1 2 3 4 5 6 7 > runs/sites.log &
    python experiments/sites_figure.py $M --seeds 0 1 2 3 4 5 6 7 --out figures/sites-intel-amx.png

Per variant of plan sites on the chip: its sites' mode, the step-0 mean |log mu - log pi| and
signed mean (metrics.jsonl's first row: mismatch_logp_abs_mean, mismatch_k1) over seeds, the
runs that fell (below causal.FELL), held-out mean +- s.e., and the paired difference with its
control (the same record with the trainer rounding to nearest), 95 % t interval, exact sign-flip
p and Holm over the table; then each fall's growth of the mismatch on the rows before its step.
The figure: each seed's held-out by variant, a dot sized by that run's step-0 mean |d|.
Exploratory, after the runs: at the same step-0 size, did one-signed errors fall more than
zero-mean ones? A run is one-signed where its record truncates or rounds away on one side only
(a truncating engine against the trainer's rne, or the trainer's trunc or away against a
rounding engine), zero-mean where the trainer rounds rne, rne6 or sym against a rounding engine
(others unclassified, the aligned trainer too). The engine rounds with AMX hidden (bf16-noamx's)
or in the chip's own library on a chip with AVX-512-BF16 and no AMX (the same kernels); it
truncates in _C_AVX512 forced or in the chip's own without AVX-512-BF16; the chip's own with AMX
(P.V in bf16 tiles) is left unclassified. Among the runs
whose step-0 mean |d| lies where both kinds ran, the falls of each kind and Fisher's exact
one-sided p (fewer zero-mean falls).
--arm grpo reads plan sites-grpo's runs; --variants these records alone, Holm over their
contrasts (a chip's second part of the plan, read apart from its first; or plan embed32's, the
CPU trainer's embedding backward summed as a GPU's, its control the same record without it:
embed32.py). Page: experiments/sites.md.
"""
import glob
import os
from dataclasses import replace

import matplotlib.pyplot as plt

from causal import FELL, growth_before_fall, print_contrasts
from common import fmt, hypergeometric, load_json, mean_se, refuse
from plans import PLANS
from results import (COLORS, holm_contrasts, load_experiment, machine_title, parse_runs,
                     runs_parser, save, with_variants)
from variants import SITE_ROUNDING as MODES, TRUNCATING, VARIANTS, formats

ARM = "gspo-engine"
ORDER = list(dict.fromkeys(v for plan in ("sites", "sites-grpo", "embed32", "gpulike")
                           for _, vs in PLANS[plan] for v in vs))

def control_of(v):
    """The same record with the trainer as it is (rounding to nearest at the sites, its
    embedding's backward torch's, its attention the emulation's), or None."""
    rec = replace(VARIANTS[v], site_rounding="rne", embed_grad="dtype",
                  attention_weights="float32").recorded()
    return next((w for w in VARIANTS if w != v and VARIANTS[w].recorded() == rec), None)

def cell_of(runs):
    runs = sorted(runs, key=lambda r: r[0])
    held = [f["heldout"] for _, _, f in runs]
    first = [rows[0] for _, rows, _ in runs]
    m, se = mean_se(held)
    return {"seeds": [s for s, _, _ in runs], "heldout": held, "mean": m, "se": se,
            "fell": sum(h < FELL for h in held),
            "step0_abs": [r["mismatch_logp_abs_mean"] for r in first],
            "step0_signed": [r["mismatch_k1"] for r in first],
            "growth_before_fall": [growth_before_fall(rows, with_fall=False)
                                   for _, rows, _ in runs]}

def own_library(path):
    """What the chip of a folder's runs (one machine: load_experiment) does in its own library:
    "rounds" (AVX-512-BF16, no AMX: the kernels AMX hidden leaves), "truncates" (no
    AVX-512-BF16: _C_AVX2 or _C_AVX512), or None (AMX: P.V in bf16 tiles, neither)."""
    args = sorted(glob.glob(os.path.join(path, "*", "args.json")))[0]
    isa = load_json(args, "campaign.py")["machine"]["cpu_isa"]
    if "amx_tile" in isa:
        return None
    return "rounds" if "avx512_bf16" in isa else "truncates"

def read(path, seeds, arm=ARM, variants=None, contrasts=None):
    """contrasts: (a, b) pairs, a minus b, Holm over them, in place of each variant's control."""
    runs, where = load_experiment(path, seeds, [arm], dial=False)
    found = runs.get(arm, {})
    cells = {v: cell_of(found[v]) for v in ORDER if v in found and v in (variants or ORDER)}
    if not cells:
        refuse(f"{path} holds no {arm} run of plan sites")
    if unread := {v for pair in contrasts or () for v in pair} - set(cells):
        refuse(f"--contrast: no runs read of {' '.join(sorted(unread))}")
    tests = holm_contrasts(cells, contrasts or [(v, control_of(v)) for v in cells])
    return {"machine": where, "arm": arm, "fell_below": FELL, "variants": cells,
            "contrasts": tests, "overlap": overlap(cells, own_library(path))}

def sign_of(v, own):
    """The sign structure of a variant's error: "one-signed", "zero-mean" or None (docstring);
    own: own_library's answer for the chip."""
    rec = VARIANTS[v]
    if formats(rec.flags)[3] != "torch":  # the aligned trainer: the engine's kernels, no error
        return None
    engine = ("rounds" if rec.hide_amx else "truncates" if rec.library == TRUNCATING
              else own if rec.library is None else None)
    if engine == "truncates":  # one-signed against the trainer's rne; others unclassified
        return "one-signed" if rec.site_rounding == "rne" else None
    if engine == "rounds" and rec.site_rounding in ("trunc", "away"):
        return "one-signed"
    if engine == "rounds" and rec.site_rounding in ("rne", "rne6", "sym"):
        return "zero-mean"
    return None

def fisher_one_sided(falls, n, total_falls, total):
    """P(at most `falls` of `n` runs fall) when `total_falls` of `total` fell (hypergeometric)."""
    ways = hypergeometric(total_falls, total, n)
    return sum(w for x, w in ways.items() if x <= falls) / sum(ways.values())

def overlap(cells, own=None):
    """Exploratory: one-signed against zero-mean runs where their step-0 sizes overlap."""
    runs = {"one-signed": [], "zero-mean": []}
    for v, c in cells.items():
        if kind := sign_of(v, own):
            runs[kind] += [(a, h < FELL) for a, h in zip(c["step0_abs"], c["heldout"])]
    if not all(runs.values()):
        return None
    lo = max(min(a for a, _ in r) for r in runs.values())
    hi = min(max(a for a, _ in r) for r in runs.values())
    if lo > hi:  # the kinds' step-0 sizes do not overlap: nothing to compare at one size
        return None
    inside = {k: [f for a, f in r if lo <= a <= hi] for k, r in runs.items()}
    one, zero = inside["one-signed"], inside["zero-mean"]
    if not any(one + zero):  # no run fell at one size (grpo): Fisher's p would test nothing
        return None
    p = fisher_one_sided(sum(zero), len(zero), sum(one) + sum(zero), len(one) + len(zero))
    return {"window": [lo, hi], "one_signed": [sum(one), len(one)],
            "zero_mean": [sum(zero), len(zero)], "p_fisher_one_sided": p}

def print_read(out):
    print(f"\n{out['arm']}: step-0 mean |d| and signed mean d (mean over seeds); runs below "
          f"{FELL}; held-out (fp32 engine), mean +- s.e. (n)\n")
    print("| variant | engine | sites | step-0 mean \\|d\\| | signed | fell | held-out |")
    print("|---|---|---|---|---|---|---|")
    for v, c in out["variants"].items():
        rec = VARIANTS[v]
        engine = rec.library or ("_C, AMX hidden" if rec.hide_amx else "the chip's own")
        print(f"| {v} | {engine} | {rec.site_rounding} | {columns(c)} |")
    if out["contrasts"]:
        print_contrasts(out["contrasts"])
    print_growth(out["variants"])
    o = out["overlap"]
    if o:
        print(f"\nexploratory, at the same step-0 size ({o['window'][0]:.3e} to "
              f"{o['window'][1]:.3e}, where both kinds ran): one-signed fell in "
              f"{o['one_signed'][0]} of {o['one_signed'][1]}, zero-mean in {o['zero_mean'][0]} "
              f"of {o['zero_mean'][1]}; Fisher's exact one-sided p {o['p_fisher_one_sided']:.4f}")
    print(f"\n{out['machine']}")

def print_growth(cells):
    """Each fallen run's growth of mean |d| on the rows before its fall's step (cell_of's); the
    runs whose batch reward fell below FELL but whose held-out did not, named."""
    print("\ngrowth of mean |d| before each fall (its largest on the rows before the fall's "
          "step, over step 0's; step)")
    for v, c in cells.items():
        runs = list(zip(c["seeds"], c["growth_before_fall"], c["heldout"]))
        falls = [f"s{s}: {g[1]:.1f}x (step {g[0]})" for s, g, h in runs
                 if g and g[1] and h < FELL]
        dips = [f"s{s} (step {g[0]})" for s, g, h in runs if g and h >= FELL]
        back = f"; a batch's reward below {FELL}, held: {', '.join(dips)}" if dips else ""
        print(f"  {v}: {', '.join(falls) or 'no fall'}{back}")

def columns(c):
    """A cell's step-0 mean |d| and signed mean (over seeds), falls and held-out: table columns."""
    n = len(c["seeds"])
    return (f"{fmt(sum(c['step0_abs']) / n, '.3e')} | {fmt(sum(c['step0_signed']) / n, '+.2e')} "
            f"| {c['fell']} of {n} | {fmt(c['mean'], '.4f')} +- {fmt(c['se'], '.4f')} ({n})")

def draw_cells(ax, cells, top, title, fontsize=9):
    """One panel: each run's held-out by variant, a dot sized by its step-0 mean |d| over top."""
    for i, (v, c) in enumerate(cells.items()):
        sizes = [12 + 120 * x / top for x in c["step0_abs"]]
        ax.scatter([i] * len(c["heldout"]), c["heldout"], s=sizes, color=COLORS.get(v),
                   alpha=0.8)
    ax.axhline(FELL, color="k", lw=0.6, ls=":")
    ax.set_xticks(range(len(cells)), list(cells), rotation=15, fontsize=7)
    ax.set_title(title, fontsize=fontsize)
    ax.grid(alpha=0.3)

def figure(out):
    fig, ax = plt.subplots(figsize=(8, 3.8))
    cells = out["variants"]
    top = max(x for c in cells.values() for x in c["step0_abs"]) or 1.0
    draw_cells(ax, cells, top, f"{out['arm']}: held-out accuracy after 40 updates, a dot a run, "
               "its size the run's step-0 mean |d|")
    machine_title(fig, out["machine"])
    return fig

def matched(path, folder="sites"):
    """The matched-size check: anatomy.py's bf16 row for each mode of the trainer against each
    engine, on one set of tokens; each mean |d| over two sizes: the trainer's trunc against
    the rounding engine (the ablation's), and the truncating engine against the rounding
    trainer (the size that fell); where off by more than 15 % of the first, the factor its
    error would need. The readings in path/folder: sites (the 0.9M GPT's warm start, seed 0),
    scale-sites (the 7M GPT's), sites-rne5 (the 0.9M GPT's again, with rne5; scale-rne5.md).
    A chip whose every library truncates (AVX2 alone) has no rounding engine: each row over the
    truncating engine's alone, the first ratio and its factor left empty ("-", null)."""
    rows = {}
    for f in sorted(glob.glob(os.path.join(path, folder, "*.json"))):
        r = load_json(f, "anatomy.py --site-rounding MODE --json F")
        if r.get("experiment") != "anatomy":  # sites.py --cost's JSON lives beside them
            continue
        engine = "truncating" if r["kernel_library"] != "_C" else "rounding"
        rows[(engine, r["site_rounding"])] = {**r["variants"]["bf16"],
                                              "tokens": (r["checkpoint"], r["tokens_sha1"]),
                                              "library": r["kernel_library"]}
    refs = [("rounding", "trunc"), ("truncating", "rne")]
    if not any(engine == "rounding" for engine, _ in rows):  # AVX2: no rounding engine to read
        refs = refs[1:]
    if len({r["tokens"] for r in rows.values()}) != 1 or not all(k in rows for k in refs):
        refuse(f"{path}/{folder}/: not one checkpoint's tokens, or no {refs} rows")
    site = rows[refs[0]]["logp_abs_mean"] if len(refs) == 2 else None
    fell = rows[refs[-1]]["logp_abs_mean"]
    ckpt, sha = next(iter(rows.values()))["tokens"]
    print(f"\nbf16 on {ckpt}, {len(rows)} readings of the same tokens (sha1 {sha}): mean |d| "
          "over the trainer's trunc against the rounding engine, and over the truncating engine "
          "against the rounding trainer\n")
    print("| engine | trainer's sites | mean \\|d\\| | signed mean d | over trunc's | to match: x "
          "| over the engine's truncation |\n|---|---|---|---|---|---|---|")
    out = {}
    for (engine, mode), r in sorted(rows.items(), key=lambda kv: (kv[0][0] != "rounding",
                                                                   MODES.index(kv[0][1]))):
        d = r["logp_abs_mean"]
        over = d / site if site else None
        needs = f"{site / d:.2f}x" if over and abs(over - 1) > 0.15 else "-"
        out[f"{engine}-{mode}"] = {"library": r["library"], "site_rounding": mode,
                                   "logp_abs_mean": d, "signed_mean": r["signed_mean"],
                                   "over_site_trunc": over, "over_engine_trunc": d / fell}
        print(f"| {engine} ({r['library']}) | {mode} | {d:.3e} | {r['signed_mean']:+.2e} | "
              f"{f'{over:.2f}' if over else '-'} | {needs} | {d / fell:.2f} |")
    return {"checkpoint": ckpt, "tokens_sha1": sha, "rows": out}

def main(argv=None):
    p = with_variants(runs_parser("size or sign: plan sites's runs, or the matched-size check "
                                  "(docstring)"))
    p.add_argument("--matched", nargs="?", const="sites", default=None, metavar="FOLDER",
                   help="the matched-size table alone, of PATH/FOLDER's readings (sites)")
    p.add_argument("--arm", default=ARM, choices=[ARM, "grpo"], help="plan sites, sites-grpo")
    p.add_argument("--contrast", nargs=2, action="append", metavar=("A", "B"),
                   help="A minus B, Holm over those given, in place of each one's control")
    args = parse_runs(p, argv)
    if args.matched:
        from common import write_json
        return write_json(args.out, matched(args.path, args.matched))
    if unknown := set(args.variants or ()) - set(ORDER):
        refuse(f"--variants: {' '.join(sorted(unknown))} in no plan sites, sites-grpo or "
               "embed32")
    out = read(args.path, args.seeds, args.arm, args.variants, args.contrast)
    print_read(out)
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
