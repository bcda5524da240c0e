"""
experiments/readme_figure.py: the README's one figure, for a newcomer: the per-token mismatch
by dtype over the steps, and the one arm where bf16 costs held-out accuracy, seed by seed.

    python experiments/readme_figure.py figures/campaign-amd.json --out figures/readme.png

Drawn from campaign_figure.py's JSON (no runs are read): left, the mean over seeds of
mean |log mu - log pi| per sampled token in arm ARM's fp32, fp16 and bf16 runs; right, each
seed's held-out accuracy (the fp32 engine's reading) in bf16 and fp16, a line a seed, with the
paired difference in the title. The 30-panel view of every arm is the campaign page's.
"""
import matplotlib.pyplot as plt
import numpy as np

from common import load_json, parser, refuse
from results import COLORS, save

ARM = "gspo-engine"  # GSPO with the engine's pi_old: the arm where bf16 costs accuracy
DTYPES = ("fp32", "fp16", "bf16")

def figure(path, out):
    exp = load_json(path, "campaign_figure.py")
    cells = exp["arms"].get(ARM, {})
    if not all(v in cells for v in DTYPES):
        refuse(f"{path} has no {ARM} runs in {', '.join(DTYPES)}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    drawn = {"machine": exp["machine"], "arm": ARM, "mismatch": {}, "heldout": {}}
    for v in DTYPES:
        c = cells[v]["curves"]["mismatch_logp_abs_mean"]
        left.plot(c["x"], c["mean"], color=COLORS[v], lw=2, label=f"{v} (n={cells[v]['n']})")
        drawn["mismatch"][v] = {"x": c["x"], "mean": c["mean"]}
    left.set(yscale="log", xlabel="RL step", ylabel="mean |log mu - log pi| a token",
             title="the mismatch, by dtype (engine and trainer alike)")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    seeds = sorted(set(cells["bf16"]["seeds"]) & set(cells["fp16"]["seeds"]))
    pairs = [[cells[v]["heldout"][cells[v]["seeds"].index(s)] for v in ("bf16", "fp16")]
             for s in seeds]
    for s, (b, f) in zip(seeds, pairs):
        right.plot([0, 1], [b, f], "o-", color="0.6" if f > b else "k", ms=4)
    bf16, fp16 = ([p[i] for p in pairs] for i in (0, 1))
    drawn["heldout"] = {"seeds": seeds, "bf16": bf16, "fp16": fp16}
    d = cells["fp16"]["heldout_minus_bf16"]
    right.set_xticks([0, 1], ["bf16", "fp16"])
    right.set(xlim=(-0.3, 1.3), ylabel="held-out accuracy (fp32 engine)",
              title=f"{ARM} (GSPO, pi_old = mu), a line a seed\nfp16 - bf16 = {d['mean']:+.4f} "
                    f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}], paired")
    for ax in (left, right):
        ax.title.set_fontsize(9)
    right.grid(alpha=0.3)
    fig.suptitle(exp["machine"], fontsize=7)
    drawn["heldout_minus_bf16"] = d
    save(fig, out, drawn)
    up, mean = sum(f > b for b, f in pairs), np.mean([f - b for b, f in pairs])
    print(f"{ARM}: fp16 above bf16 on {up} of {len(pairs)} seeds; {mean:+.4f}")

def main(argv=None):
    p = parser("the README's figure (the docstring)")
    p.add_argument("experiment", help="the JSON campaign_figure.py wrote")
    p.add_argument("--out", required=True, help="the PNG; its JSON beside it")
    args = p.parse_args(argv)
    figure(args.experiment, args.out)

if __name__ == "__main__":
    main()
