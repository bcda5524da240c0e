"""
plot.py: the figures. Each is drawn from files a command wrote, and prints the figures it shows.

    python plot.py runs/fp16 runs/bf16 runs/fp32 --out runs/rl.png               # runs, one colour per dtype
    python plot.py --probe runs/probe.json --out figures/probe.png              # each token's mu against pi
    python plot.py --experiment runs/exp --out figures/experiment.png           # seeds: mean and spread

Runs: each folder holds args.json (its flags, with the dtype) and metrics.jsonl (one row per step);
per run it prints the README's table rows (results, and medians of the timings). Per-step values are
noisy at this batch size: thin lines are the raw values, thick ones a moving average over --smooth steps.
Probe: one panel per dtype, every sampled token's engine probability mu against the trainer's pi.
Experiment: run folders named ARM-DTYPE-sSEED; one row of panels per arm, one line per dtype (the mean
over seeds, the spread between seeds shaded); it writes the numbers it draws to a JSON beside the PNG.
"""
import argparse
import json
import os
import sys

import matplotlib
import numpy as np

matplotlib.use("Agg")  # write files, never open a window
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"fp16": "tab:blue", "bf16": "tab:red", "fp32": "0.35"}
PANELS = [("reward_mean", "training reward", "linear"), ("eval_accuracy", "held-out accuracy", "linear"),
          ("mismatch_k3", "mismatch k3 = KL(mu || pi) estimate", "log"),
          ("mismatch_prob_abs_max", "max |mu - pi| over a batch", "log"),
          ("grad_norm", "gradient norm (before clipping)", "log"), ("response_len_mean", "response length", "linear")]


def fail(message):
    print(f"error: {message}", file=sys.stderr)  # one line, exit 2, like train_grpo.py
    sys.exit(2)


def load_run(folder):
    try:
        with open(os.path.join(folder, "args.json")) as f:
            dtype = json.load(f)["dtype"]
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError, KeyError) as e:
        fail(f"{folder} is not a train_grpo.py run folder ({e})")
    if not rows:
        fail(f"{folder} has no RL steps yet")
    try:  # a finished run also has the held-out accuracy before RL
        with open(os.path.join(folder, "summary.json")) as f:
            rows = [{"step": -1, "eval_accuracy": json.load(f)["eval_accuracy_before"]}] + rows
    except (OSError, ValueError, KeyError):
        pass
    return dtype, rows


def report(folder, dtype, rows):
    """Print the figures the README quotes for a run, all from its files: held-out accuracy before
    and after, the mean of the last 10 rewards and of k3, and medians over the steps."""
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    med = {k: float(np.median([r[k] for r in steps])) for k in
           ("mismatch_prob_abs_max", "time_step_s", "time_rollout_s", "time_logprob_s", "time_train_s",
            "time_sync_s", "rollout_tokens_per_s")}
    print(f"{folder} ({dtype}): held-out {evals[0]:.3f} -> {evals[-1]:.3f} | last-10 reward "
          f"{np.mean([r['reward_mean'] for r in steps[-10:]]):.3f} | k3 mean {np.mean([r['mismatch_k3'] for r in steps]):.1e}"
          f" | max|mu - pi| median {med['mismatch_prob_abs_max']:.1e}\n    median step {med['time_step_s']:.2f} s: "
          f"rollout {med['time_rollout_s']:.2f}, log-prob {med['time_logprob_s']:.2f}, train {med['time_train_s']:.2f}, "
          f"sync {med['time_sync_s']:.3f} ({med['time_sync_s'] / med['time_step_s']:.1%}) | "
          f"{med['rollout_tokens_per_s']:.0f} sampled tokens/s")


def save(fig, out):
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)  # never a half-written PNG
    print(f"written {out}")


def plot_runs(args):
    runs = [(folder, *load_run(folder)) for folder in args.runs]
    for folder, dtype, rows in runs:
        report(folder, dtype, rows)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, label, yscale) in zip(axes.flat, PANELS):
        for folder, dtype, rows in runs:
            folder_name = os.path.basename(os.path.normpath(folder))
            color, name = COLORS.get(dtype), dtype if folder_name == dtype else f"{dtype} ({folder_name})"
            # a log axis cannot show 0 (an fp32 run's mismatch can be exactly 0 on some steps)
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and (yscale == "linear" or r[key] > 0)]
            if not pts:
                continue
            x, y = np.array(pts, dtype=float).T
            if key == "eval_accuracy":  # measured after step s, so after s + 1 updates; before RL = 0
                ax.plot(x + 1, y, "o-", color=color, label=name)
                continue
            ax.plot(x, y, color=color, alpha=0.25, lw=0.8)
            w = min(args.smooth, len(y))  # moving average over the last w steps
            ax.plot(x[w - 1:], np.convolve(y, np.ones(w) / w, mode="valid"), color=color, lw=2, label=name)
        ax.set_title(label)
        ax.set_yscale(yscale)
        ax.set_xlabel("RL step (= updates made before it)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    fig.suptitle(args.title or "GRPO with vLLM rollouts: " + ", ".join(sorted({d for _, d, _ in runs})))
    fig.tight_layout()
    save(fig, args.out)


def plot_probe(args):
    """The paper's picture of the mismatch: each sampled token's probability under the engine (mu)
    against the trainer's (pi), same weights, same dtype on both sides; and, below, mu - pi itself."""
    try:
        with open(args.probe) as f:
            result = json.load(f)
        tokens = result["tokens"]
    except (OSError, ValueError, KeyError) as e:
        fail(f"{args.probe} is not the JSON of `probe.py mismatch --json` ({e})")
    fig, axes = plt.subplots(2, len(tokens), figsize=(4.6 * len(tokens), 8.4), squeeze=False)
    for col, dtype in enumerate(d for d in ("bf16", "fp16", "fp32") if d in tokens):
        mu, pi = np.exp(tokens[dtype]["mu"]), np.exp(tokens[dtype]["pi"])
        top, bottom = axes[0, col], axes[1, col]
        top.scatter(pi, mu, s=2, alpha=0.3, color=COLORS[dtype], rasterized=True)
        top.plot([0, 1], [0, 1], color="k", lw=0.6)
        top.set(title=f"{dtype}: engine and trainer both {dtype}", xlabel="trainer probability pi",
                ylabel="engine probability mu", xlim=(0, 1), ylim=(0, 1))
        bottom.scatter(pi, mu - pi, s=2, alpha=0.3, color=COLORS[dtype], rasterized=True)
        bottom.axhline(0, color="k", lw=0.6)
        lim = max(np.abs(np.exp(tokens["bf16"]["mu"]) - np.exp(tokens["bf16"]["pi"])).max(), 1e-6) * 1.05
        bottom.set(xlabel="trainer probability pi", ylabel="mu - pi (same scale in every panel)", xlim=(0, 1),
                   ylim=(-lim, lim))
        print(f"{dtype}: {len(mu)} tokens, max |mu - pi| {np.abs(mu - pi).max():.2e}, mean {np.abs(mu - pi).mean():.2e}")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    m = result.get("machine", {})
    fig.suptitle(f"Every sampled token, {result['sequences_per_engine']} responses per dtype, {result['checkpoint']}\n"
                 f"{m.get('gpu') or m.get('cpu')}, {m.get('vllm')}")
    fig.tight_layout()
    save(fig, args.out)


EXP_PANELS = [("reward_mean", "training reward", "linear"), ("eval_accuracy", "held-out accuracy", "linear"),
              ("mismatch_logp_abs_mean", "mean |log mu - log pi|", "log")]
CLIP_PANELS = [("clip_frac_pos", "clipped tokens, A > 0", "linear"), ("clip_frac_neg", "clipped tokens, A < 0", "linear")]
IS_PANELS = [("is_weight_mean", "IS weight, batch mean", "linear"), ("is_weight_max", "IS weight, batch max", "linear")]


def plot_experiment(args):
    """Folders ARM-DTYPE-sSEED under args.experiment: per arm and dtype, each quantity's mean over the
    seeds per step and its spread (min to max), and the table the README quotes."""
    runs = {}
    for name in sorted(os.listdir(args.experiment)):
        folder = os.path.join(args.experiment, name)
        arm, _, seed = name.rpartition("-s")
        arm, _, dtype = arm.rpartition("-")
        if os.path.isfile(os.path.join(folder, "summary.json")):  # finished runs only
            with open(os.path.join(folder, "summary.json")) as f:
                summary = json.load(f)
            runs.setdefault(arm, {}).setdefault(dtype, []).append((seed, load_run(folder)[1], summary))
    if not runs:
        fail(f"{args.experiment} holds no finished run folder named ARM-DTYPE-sSEED")
    out = {"arms": {}}
    ncols = len(EXP_PANELS) + len(CLIP_PANELS)  # the last panels show clipping or IS weights, by arm
    fig, axes = plt.subplots(len(runs), ncols, figsize=(4 * ncols, 3.2 * len(runs)), squeeze=False)
    for row, (arm, by_dtype) in enumerate(runs.items()):
        out["arms"][arm] = {}
        for dtype in (d for d in ("fp16", "bf16", "fp32") if d in by_dtype):
            seeds = by_dtype[dtype]
            final = [s["eval_accuracy_after"] for _, _, s in seeds]
            last10 = [s["reward_mean_last10"] for _, _, s in seeds]
            cell = {"seeds": [s for s, _, _ in seeds], "eval_after": final, "reward_last10": last10,
                    "eval_before": [s["eval_accuracy_before"] for _, _, s in seeds], "curves": {}}
            for key in ("clip_frac_pos", "clip_frac_neg", "clip_seq_frac", "mismatch_logp_abs_mean", "is_weight_max"):
                vals = [r[key] for _, rows, _ in seeds for r in rows if r.get(key) is not None]
                cell[key + "_mean"] = float(np.mean(vals)) if vals else None
            clipped = cell["clip_frac_pos_mean"] is not None  # PPO-style arms log clipping, the others IS weights
            for col, (key, label, yscale) in enumerate(EXP_PANELS + (CLIP_PANELS if clipped else IS_PANELS)):
                curves = [{r["step"]: r[key] for r in rows if r.get(key) is not None} for _, rows, _ in seeds]
                steps = sorted(set.intersection(*(set(c) for c in curves)))
                if not steps:
                    continue
                y = np.array([[c[t] for t in steps] for c in curves])
                x = np.array(steps) + (1 if key == "eval_accuracy" else 0)  # eval after step s: s + 1 updates
                cell["curves"][key] = {"x": x.tolist(), "mean": y.mean(0).tolist(), "min": y.min(0).tolist(),
                                       "max": y.max(0).tolist()}
                ax = axes[row, col]
                ax.plot(x, y.mean(0), "o-" if key == "eval_accuracy" else "-", color=COLORS[dtype], lw=1.6,
                        ms=3, label=f"{dtype} ({len(seeds)} seeds)")
                ax.fill_between(x, y.min(0), y.max(0), color=COLORS[dtype], alpha=0.15, lw=0)
                ax.set_yscale(yscale)
                ax.set_title(f"{arm}: {label}", fontsize=10)
                ax.grid(alpha=0.3)
            axes[row, 0].legend(fontsize=8)
            out["arms"][arm][dtype] = cell
            print(f"{arm:12} {dtype}: held-out after {np.mean(final):.3f} +- {np.std(final):.3f} | last-10 reward "
                  f"{np.mean(last10):.3f} +- {np.std(last10):.3f} | clipped A>0 {fmt(cell['clip_frac_pos_mean'])} "
                  f"A<0 {fmt(cell['clip_frac_neg_mean'])} | IS weight max {fmt(cell['is_weight_max_mean'])} | mean |log mu - log pi| {fmt(cell['mismatch_logp_abs_mean_mean'])}"
                  f" | seeds {len(seeds)}")
    for ax in axes[-1]:
        ax.set_xlabel("RL step")
    fig.suptitle(args.title or "Mean over seeds (line) and the seeds' spread, min to max (shade)")
    fig.tight_layout()
    save(fig, args.out)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print(f"written {os.path.splitext(args.out)[0]}.json")


def fmt(v):
    return "-" if v is None else f"{v:.2e}"


def main(argv=None):
    p = argparse.ArgumentParser(description="the figures: runs, the probe's tokens, the seeds experiment")
    p.add_argument("runs", nargs="*", help="run folders (--out of train_grpo.py)")
    p.add_argument("--probe", default=None, help="the JSON of `probe.py mismatch --json`")
    p.add_argument("--experiment", default=None, help="a folder of runs named ARM-DTYPE-sSEED")
    p.add_argument("--out", default="figures/rl.png", help="PNG to write")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window, in steps")
    p.add_argument("--title", default=None)
    p.error = fail  # argparse would add a usage block
    args = p.parse_args(argv)
    if args.smooth < 1:
        fail("--smooth must be at least 1")
    if sum(map(bool, (args.runs, args.probe, args.experiment))) != 1:
        fail("give run folders, or --probe FILE, or --experiment DIR (one of them)")
    plot_probe(args) if args.probe else plot_experiment(args) if args.experiment else plot_runs(args)


if __name__ == "__main__":
    main()
