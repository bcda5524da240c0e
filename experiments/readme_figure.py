"""
experiments/readme_figure.py: the README's one figure, for a newcomer: the per-token mismatch
by dtype over the steps, and what it did to RL, run by run: GSPO on the engine's log-probs fell
where the engine truncated to bf16 against a trainer that rounds, on two chips, and held
wherever both sides rounded alike (fp16, or bf16 on a rounding engine) or truncated alike.

    python experiments/readme_figure.py figures/campaign-amd.json figures/causal-amd-avx2.json \
        figures/causal-intel-amx.json --out figures/readme.png

Drawn from campaign_figure.py's and causal.py's JSON (no runs are read): left, the mean over
seeds of mean |log mu - log pi| per sampled token in arm ARM's fp32, fp16 and bf16 runs; right,
each causal run's held-out accuracy (the fp32 engine's reading), a dot a seed, by chip and
variant, coloured by whether the engine and the trainer round the same way.
"""
import matplotlib.pyplot as plt

from common import load_json, parser, refuse
from results import COLORS, save

ARM = "gspo-engine"  # GSPO with the engine's pi_old: the arm where bf16 fell
DTYPES = ("fp32", "fp16", "bf16")
# Per chip: (variant, its label, whether one side truncates and the other rounds)
COLUMNS = ((("bf16", "bf16\ntrunc vs round", True), ("bf16-aligned", "bf16\nboth trunc", False),
            ("fp16", "fp16", False)),
           (("bf16", "bf16\nboth round", False), ("bf16-trunc", "bf16\ntrunc vs round", True),
            ("bf16-trunc-aligned", "bf16\nboth trunc", False), ("fp16", "fp16", False)))
CHIPS = ("AMD EPYC, AVX2\n(its engine truncates)", "Intel Xeon, AMX\n(its engine rounds)")

def mismatch_panel(ax, exp, drawn):
    cells = exp["arms"].get(ARM, {})
    if not all(v in cells for v in DTYPES):
        refuse(f"the campaign JSON has no {ARM} runs in {', '.join(DTYPES)}")
    for v in DTYPES:
        c = cells[v]["curves"]["mismatch_logp_abs_mean"]
        ax.plot(c["x"], c["mean"], color=COLORS[v], lw=2, label=f"{v} (n={cells[v]['n']})")
        drawn["mismatch"][v] = {"x": c["x"], "mean": c["mean"]}
    ax.set(yscale="log", xlabel="RL step", ylabel="mean |log mu - log pi| a token",
           title=f"the mismatch by dtype, {ARM}\n{exp['machine'].split(',')[0]}")
    ax.legend(fontsize=8)

def runs_panel(ax, causal, drawn):
    x, ticks = 0, []
    for chip, exp, columns in zip(CHIPS, causal, COLUMNS):
        variants = exp["arms"].get(ARM, {}).get("variants", {})
        drawn["runs"][chip] = {}
        for v, label, mixed in columns:
            if v not in variants:
                refuse(f"a causal JSON has no {ARM} runs of {v}")
            held = variants[v]["heldout"]
            ax.scatter([x] * len(held), held, s=16, color="tab:red" if mixed else "tab:blue")
            drawn["runs"][chip][v] = {"seeds": variants[v]["seeds"], "heldout": held,
                                      "fell": variants[v]["fell"]}
            ticks.append((x, label))
            x += 1
        ax.text(x - len(columns) / 2 - 0.5, 1.04, chip, ha="center", fontsize=8)
        x += 0.6
    ax.axhline(0.5, color="k", lw=0.6, ls=":")
    ax.set_xticks([t for t, _ in ticks], [lab for _, lab in ticks], fontsize=7)
    ax.set(ylim=(-0.02, 1.15), ylabel="held-out accuracy after 40 updates",
           title=f"{ARM} (GSPO, pi_old = mu): a dot a seed; red: one side truncates")

def figure(campaign, causal, out):
    exp, causal = load_json(campaign, "campaign_figure.py"), [load_json(p, "causal.py")
                                                              for p in causal]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2),
                                      gridspec_kw={"width_ratios": [1, 1.6]})
    drawn = {"machines": [exp["machine"], *(c["machine"] for c in causal)], "arm": ARM,
             "mismatch": {}, "runs": {}}
    mismatch_panel(left, exp, drawn)
    runs_panel(right, causal, drawn)
    for ax in (left, right):
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    save(fig, out, drawn)
    for chip, runs in drawn["runs"].items():
        fell = ", ".join(f"{v} {r['fell']} of {len(r['heldout'])}" for v, r in runs.items())
        print(f"{chip.splitlines()[0]}: fell {fell}")

def main(argv=None):
    p = parser("the README's figure (the docstring)")
    p.add_argument("campaign", help="the JSON campaign_figure.py wrote")
    p.add_argument("causal", nargs=2, help="causal.py's JSON: the AVX2 chip's, the AMX chip's")
    p.add_argument("--out", required=True, help="the PNG; its JSON beside it")
    args = p.parse_args(argv)
    figure(args.campaign, args.causal, args.out)

if __name__ == "__main__":
    main()
