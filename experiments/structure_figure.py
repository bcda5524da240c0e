"""
experiments/structure_figure.py: the dial with structure. Does a bias (temperature), or an
error held along a sequence (persistent), cost RL more than uniform noise of the same size?
(campaign.py --plan dial-structure; dial.py's shapes; prediction in structure.md.)

    python experiments/structure_figure.py results/amd-epyc-avx2 --seeds 0 1 2 3 4 \
        --arms gspo-engine --doses 0 1 3 10 --out figures/structure-amd-avx2.png

Per arm, one axis: each shape's held-out accuracy minus dose 0's (paired by seed, 95 % t
interval) against the mismatch its runs realised at step 0; then the table: per arm, dose and
structured shape, the shape minus uniform at the same dose, paired by seed (mean, 95 %
interval, exact sign-flip p, Holm over every test in the table). The numbers drawn go to a
JSON beside the PNG. Page: experiments/structure.md.
"""
import numpy as np

from common import holm
from dial_figure import DOSE0, dial_table
from results import machine_title, paired_seeds, parse_runs, plt, runs_parser, save

SHAPES = {"uniform": "tab:gray", "temperature": "tab:red", "persistent": "tab:blue"}

def against_uniform(out, arm, shape):
    """Per dose both shapes ran: shape minus uniform, paired by seed (held-out)."""
    cells = [out["shapes"].get(s, {}).get("arms", {}).get(arm) for s in (shape, "uniform")]
    if None in cells:
        return []
    doses = sorted(set(cells[0]["doses"]) & set(cells[1]["doses"]) - {0})
    pairs = [(dose, [c["cells"][str(dose)] for c in cells]) for dose in doses]
    return [{"arm": arm, "shape": shape, "dose": dose, **d} for dose, (a, b) in pairs
            if (d := paired_seeds(a, b, "heldout"))]

def draw(ax, out, arm):
    """Each shape's paired difference from dose 0 against the realised step-0 mismatch."""
    for shape, color in SHAPES.items():
        entry = out["shapes"].get(shape, {}).get("arms", {}).get(arm)
        if not entry or not entry["heldout"]["paired"]:
            continue
        doses = [int(d) for d in entry["heldout"]["paired"]]
        diff = [entry["heldout"]["paired"][str(d)] for d in doses]
        x = [np.mean(entry["cells"][str(d)]["mismatch_step0"]) for d in doses]
        y = np.array([d["mean"] for d in diff])
        err = np.abs(np.array([d["ci95"] for d in diff]).T - y)
        ax.errorbar(x, y, yerr=err, fmt="o-", ms=4, capsize=3, color=color, label=shape)
    ax.axhline(0, color="k", lw=0.6)
    ax.axvline(out["unit"], color="k", lw=0.6, ls=":")  # the chip's own bf16 mismatch
    ax.set_xscale("log")
    ax.set_xlim(left=DOSE0 * out["unit"] * 10)
    ax.set_xlabel("mean |log mu - log pi| a token at step 0 (dotted: this chip's bf16)")
    ax.set_title(f"{arm}: held-out minus dose 0 (95 % CI)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

def main(argv=None):
    p = runs_parser("the dial with structure: bias and held noise against uniform noise")
    p.add_argument("--doses", type=int, nargs="+", help="these doses alone (0: the control)")
    args = parse_runs(p, argv)
    arms = args.arms or ["gspo-engine", "grpo"]
    out = dial_table(args.path, args.seeds, arms, args.doses)
    tests = [r for arm in arms for s in ("temperature", "persistent")
             for r in against_uniform(out, arm, s)]
    for r, ph in zip(tests, holm([r["p_sign_flip"] for r in tests])):
        r["p_holm"] = ph
    out["against_uniform"] = tests
    print(f"held-out, the shape minus uniform at the same dose, paired by seed; Holm over "
          f"{len(tests)}\n\n| arm | shape | dose | n | mean [95 % CI] | p | Holm |\n"
          "|---|---|---|---|---|---|---|")
    for r in tests:
        print(f"| {r['arm']} | {r['shape']} | {r['dose']}x | {r['n']} | {r['mean']:+.4f} "
              f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}] | {r['p_sign_flip']:.4f} | "
              f"{r['p_holm']:.4f} |")
    fig, axes = plt.subplots(1, len(arms), figsize=(5.5 * len(arms), 3.8), squeeze=False)
    for ax, arm in zip(axes[0], arms):
        draw(ax, out, arm)
    machine_title(fig, out["machine"])
    save(fig, args.out, out)

if __name__ == "__main__":
    main()
