"""
experiments/scale.py: does the rounding's effect hold on a GPT about eight times larger? The
causal test's headline contrast (causal.md) and the cheap fix (sites.md) on arm gspo-engine-x8
(variants.py: gspo-engine's flags, SCALE's 8 layers, 8 heads of 32, width 256), five seeds,
read beside the same variants' runs of gspo-engine (the 0.9M GPT) at the same seeds.

First each seed's two warm starts (trained here unless cached, as train_grpo.py would train
them) and their held-out accuracy by one fp32 engine (heldout.py, a JSON each in $M/scale/):
the larger's must reach at least the smaller's before its runs count.

    python experiments/scale.py $M --warm-starts --seeds 0 1 2 3 4 \
        --out figures/scale-warm-starts-intel-amx.json

Then the runs, their table and figure (on a chip without AMX whose own library rounds,
--plan scale-own in both: that library, bf16, is the rounding control; --plan scale-fp16 in
both: fp16 beside bf16, scale-fp16.md; --plan scale-sites on any chip without AMX: the aligned
trainer and the trainer's rounding at the two sites beside the chip's bf16, scale-sites.md;
--plan scale-rne5 where the engine rounds: a larger zero-mean error, scale-rne5.md; --plan
scale-grpo: vanilla GRPO, arms grpo-x8 and grpo, scale-grpo.md; scale-grpo-trunc, the same
with the engine's truncating library forced; scale-embed32, the CPU trainer's embedding backward
summed in float32 against that library, embed32.md; scale-truncpm2, the cheap fix's sign with a
2-ulp zero-mean step added against that library, scale-truncpm2.md; scale-sym, a zero-mean
rounding of truncation's size at the op against that library, scale-sym.md):

    nohup python experiments/campaign.py --plan scale --seeds 0 1 2 3 4 > runs/scale.log &
    python experiments/scale.py $M --seeds 0 1 2 3 4 --out figures/scale-intel-amx.png

Per arm and variant (the plan's): the step-0 mean |log mu - log pi| and signed mean over
seeds, the runs that fell (held-out below causal.FELL), held-out mean +- s.e. (n); then
the contrasts paired by seed (95 % t interval, exact sign-flip p), Holm over each arm's own: the
larger GPT's are the pre-registered family (scale.md); then each fall's growth of the mismatch
on the rows before its step (sites_figure.print_growth). The figure: a panel per arm, each
seed's held-out by variant, a dot sized by that run's step-0 mean |d|. --arms reads one arm
alone (its numbers as beside the other); --warm-starts reads both, a seed's row the pair.
Pages: experiments/scale.md, scale-fp16.md, scale-sites.md, scale-rne5.md, scale-grpo.md,
embed32.md, scale-truncpm2.md, scale-sym.md.
"""
import os
import subprocess
import sys

import matplotlib.pyplot as plt

from causal import FELL, print_contrasts
from common import HERE, load, refuse, write_json
from plans import PLANS
from results import holm_contrasts, load_experiment, machine_title, parse_runs
from results import runs_parser, save
from sites_figure import cell_of, columns, draw_cells, print_growth
from variants import ARMS, SMALLER

# The warm starts' arms: every larger arm starts from one warm start a seed (variants.SMALLER),
# so the readings of gspo-engine's two say whether a seed's runs count in every plan.
SMALL, LARGE = "gspo-engine", PLANS["scale"][0][0]

def arms_of(plan):
    """(the 0.9M GPT's arm, the larger GPT's) that a plan is read on: its first arm and twin."""
    large = PLANS[plan][0][0]
    return SMALLER[large], large

def rounding_family(control):
    """Plan scale's contrasts and step-0 ratios, against the chip's rounding control."""
    tests = [("bf16-trunc", control),  # the rounding: does it still make GSPO fall?
             ("bf16-trunc-aligned", "bf16-trunc"),  # the aligned trainer, mismatch 0
             ("bf16-trunc-site-trunc", "bf16-trunc")]  # the cheap fix (sites.md)
    return tests, [("bf16-trunc", control), ("bf16-trunc-site-trunc", control)]

# Each plan's pre-registered contrasts and step-0 ratios: the rounding control is the chip's
# rounding library, AMX hidden where there is AMX; the paper's fix is read against bf16.
FAMILIES = {"scale": rounding_family("bf16-noamx"), "scale-own": rounding_family("bf16"),
            "scale-fp16": ([("fp16", "bf16")], [("fp16", "bf16")]),
            # each against the chip's own bf16, whether its library rounds or truncates; rne6's
            # size against truncation's, the two the same size at the op (sites.md)
            "scale-sites": ([("bf16-aligned", "bf16"), ("bf16-site-trunc", "bf16"),
                             ("bf16-site-rne6", "bf16")],
                            [("bf16-site-trunc", "bf16"), ("bf16-site-rne6", "bf16-site-trunc")]),
            # the size dial: a zero-mean error larger than rne6's, against bf16 (scale-rne5.md)
            "scale-rne5": ([("bf16-site-rne5", "bf16")],
                           [("bf16-site-rne5", "bf16-site-trunc"), ("bf16-site-rne5", "bf16")]),
            # vanilla GRPO, pi_old the trainer's: does the trainer's truncation cost it at 7M?
            "scale-grpo": ([("bf16-site-trunc", "bf16")], [("bf16-site-trunc", "bf16")]),
            # ... and with the engine's truncating library forced (where the chip can run it)
            "scale-grpo-trunc": ([("bf16-trunc", "bf16")], [("bf16-trunc", "bf16")]),
            # the CPU trainer's embedding backward as a GPU's, the engine truncating (embed32.md)
            "scale-embed32": ([("bf16-trunc-embed32", "bf16-trunc")],
                              [("bf16-trunc-embed32", "bf16-trunc")]),
            # the cheap fix's sign, its size undone: truncpm2 and the cheap fix against
            # bf16-trunc, truncpm2's size against both (scale-truncpm2.md)
            "scale-truncpm2": ([("bf16-trunc-site-trunc", "bf16-trunc"),
                                ("bf16-trunc-site-truncpm2", "bf16-trunc")],
                               [("bf16-trunc-site-truncpm2", "bf16-trunc"),
                                ("bf16-trunc-site-truncpm2", "bf16-trunc-site-trunc")]),
            # a zero-mean rounding of truncation's size at the op against bf16-trunc, and the
            # cheap fix (the sign matched) against it; sym's size against both (scale-sym.md)
            "scale-sym": ([("bf16-trunc-site-sym", "bf16-trunc"),
                           ("bf16-trunc-site-trunc", "bf16-trunc-site-sym")],
                          [("bf16-trunc-site-sym", "bf16-trunc"),
                           ("bf16-trunc-site-sym", "bf16-trunc-site-trunc")])}

def step0_ratios(cells, pairs):
    """Each pair's step-0 mean |d|, the first's over the second's, seed by seed: mean, range."""
    out = {}
    for a, b in pairs:
        both = a in cells and b in cells and sorted(set(cells[a]["seeds"]) & set(cells[b]["seeds"]))
        if both:  # seeds both have
            r = [cells[a]["step0_abs"][cells[a]["seeds"].index(s)]
                 / cells[b]["step0_abs"][cells[b]["seeds"].index(s)] for s in both]
            out[f"{a} / {b}"] = {"seeds": both, "mean": sum(r) / len(r), "range": [min(r), max(r)]}
    return out

def warm_start_of(arm, seed):
    """(checkpoint folder, parameters) of the warm start an arm's runs begin from, from the
    flags train_grpo.py reads; trained here unless cached. torch only here: the table and
    figure import none."""
    import train_grpo
    from model import load_hf
    from precision import get_precision
    from warm_start import model_config, warm_start
    a = train_grpo.get_args([*ARMS[arm], "--seed", str(seed), "--out", os.devnull])  # no run
    cfg = model_config(a.n_items, a.max_new_tokens, a.n_layer, a.n_head, a.n_embd)
    device = get_precision(a.dtype).device  # where train_grpo.py would train it
    ckpt = warm_start(cfg, a.n_items, seed, device)
    return ckpt, sum(p.numel() for p in load_hf(ckpt, device).parameters())

def warm_starts(path, seeds):
    """Each seed's two warm starts' held-out accuracy (heldout.py, a process each: one engine
    configuration a process), the larger's minus the smaller's, and whether it reaches it."""
    out = {}
    for seed in seeds:
        row = {}
        for arm in (SMALL, LARGE):
            ckpt, params = warm_start_of(arm, seed)
            json_path = os.path.join(path, "scale", f"warmstart-{arm}-s{seed}.json")
            if (load(json_path) or {}).get("checkpoint") != ckpt:  # a reading of it is kept
                os.makedirs(os.path.dirname(json_path), exist_ok=True)
                subprocess.run([sys.executable, os.path.join(HERE, "heldout.py"), "--init",
                                ckpt, "--seed", str(seed), "--json", json_path], check=True)
            r = load(json_path)
            row[arm] = {"checkpoint": ckpt, "parameters": params, "accuracy": r["accuracy"],
                        "se": r["se"]}
        gap = row[LARGE]["accuracy"] - row[SMALL]["accuracy"]
        out[f"s{seed}"] = {**row, "larger_minus_smaller": gap, "reaches": reaches(path, seed)}
    print(f"\nwarm starts' held-out accuracy (fp32 engine), {SMALL} | {LARGE}\n")
    print("| seed | parameters | smaller | larger | larger - smaller | reaches |")
    print("|---|---|---|---|---|---|")
    for s, row in out.items():
        a, b = row[SMALL], row[LARGE]
        print(f"| {s} | {a['parameters']:,} / {b['parameters']:,} | {a['accuracy']:.4f} +- "
              f"{a['se']:.4f} | {b['accuracy']:.4f} +- {b['se']:.4f} | "
              f"{row['larger_minus_smaller']:+.4f} | {'yes' if row['reaches'] else 'no'} |")
    return out

def reaches(path, seed):
    """Whether seed's larger warm start reached the smaller's held-out (warm_starts' readings),
    or None where they are not both read."""
    r = [load(os.path.join(path, "scale", f"warmstart-{a}-s{seed}.json")) for a in (SMALL, LARGE)]
    return None if None in r else r[1]["accuracy"] >= r[0]["accuracy"]

def read(path, seeds, plan="scale", arms=None):
    """The two arms' cells and contrasts (or those of ARMS alone), the plan's variants; the
    larger's runs of a seed whose warm start fell short of the smaller's are left out (scale.md),
    the seeds not yet checked named."""
    small, large = arms_of(plan)
    if unknown := set(arms or []) - {small, large}:
        refuse(f"--arms {' '.join(sorted(unknown))}: scale reads {small} and {large}")
    runs, where = load_experiment(path, seeds, arms or [small, large], dial=False)
    ran = {s for cell in runs.get(large, {}).values() for s, _, _ in cell}
    checked = {s: reaches(path, s) for s in sorted(ran)}
    for v, cell in runs.get(large, {}).items():
        runs[large][v] = [run for run in cell if checked[run[0]] is not False]
    tables, listed = {}, dict(PLANS[plan])  # an arm the plan leaves out reads its first arm's
    for arm in (a for a in (small, large) if a in runs):
        found = {v: cell for v, cell in runs[arm].items() if cell}
        variants = listed.get(arm, PLANS[plan][0][1])
        cells = {v: cell_of(found[v]) for v in variants if v in found}
        tests = holm_contrasts(cells, FAMILIES[plan][0])
        ratios = step0_ratios(cells, FAMILIES[plan][1])
        tables[arm] = {"variants": cells, "contrasts": tests, "step0_ratios": ratios}
    if not any(a["variants"] for a in tables.values()):
        refuse(f"{path} holds no finished run of plan {plan}'s variants on {small} or {large}")
    return {"machine": where, "fell_below": FELL, "arms": tables, "warm_start_reaches": checked}

def print_read(out, large=LARGE):
    for arm, a in out["arms"].items():
        print(f"\n{arm}: step-0 mean |d| and signed mean d (mean over seeds); runs below "
              f"{FELL}; held-out (fp32 engine), mean +- s.e. (n)\n")
        print("| variant | step-0 mean \\|d\\| | signed | fell | held-out |\n|---|---|---|---|---|")
        for v, c in a["variants"].items():
            print(f"| {v} | {columns(c)} |")
        if a["contrasts"]:
            print_contrasts(a["contrasts"])
        print_growth(a["variants"])
        for pair, r in a["step0_ratios"].items():
            print(f"step-0 mean |d|, {pair}, seed by seed: mean {r['mean']:.2f}x, "
                  f"{r['range'][0]:.2f}x to {r['range'][1]:.2f}x (n = {len(r['seeds'])})")
    checked = out["warm_start_reaches"]
    print(f"\n{large}'s warm start reached the smaller's: seeds "
          f"{[s for s, ok in checked.items() if ok]}; fell short, left out: "
          f"{[s for s, ok in checked.items() if ok is False]}; not read: "
          f"{[s for s, ok in checked.items() if ok is None]}")
    print(f"\n{out['machine']}")

def figure(out):
    n = len(out["arms"])
    fig, axes = plt.subplots(1, n, figsize=(4.5 * n, 3.6), sharey=True, squeeze=False)
    cells = [c for a in out["arms"].values() for c in a["variants"].values()]
    top = max(x for c in cells for x in c["step0_abs"]) or 1.0
    for ax, (arm, a) in zip(axes[0], out["arms"].items()):
        draw_cells(ax, a["variants"], top,
                   f"{arm}: held-out after 40 updates; dot size: step-0 mean |d|", fontsize=8)
    machine_title(fig, out["machine"])
    return fig

def main(argv=None):
    p = runs_parser("scale: plan scale's runs beside the 0.9M GPT's, or the warm starts")
    p.add_argument("--warm-starts", action="store_true", help="the warm starts' table alone")
    p.add_argument("--plan", choices=FAMILIES, default="scale",
                   help="scale (AMX hidden for the control), scale-own (the chip's own library), "
                        "scale-fp16 (fp16 beside bf16), scale-sites (the aligned trainer and "
                        "the trainer's rounding at the two sites beside bf16), scale-rne5 "
                        "(a zero-mean error larger than rne6's), scale-grpo (vanilla GRPO, "
                        "grpo-x8 beside grpo), scale-grpo-trunc (the same, the engine "
                        "truncating), scale-embed32 (the CPU trainer's embedding backward "
                        "in float32, the engine truncating), scale-truncpm2 (the cheap "
                        "fix's sign, a 2-ulp zero-mean step added) or scale-sym (a zero-mean "
                        "rounding, the engine truncating)")
    args = parse_runs(p, argv)
    if args.warm_starts and args.arms:  # a seed's row sets the larger beside the smaller
        refuse("--warm-starts reads both arms' warm starts: drop --arms")
    if args.warm_starts:
        return write_json(args.out, warm_starts(args.path, args.seeds or [0]))
    out = read(args.path, args.seeds, args.plan, args.arms)
    print_read(out, arms_of(args.plan)[1])
    save(figure(out), args.out, out)

if __name__ == "__main__":
    main()
