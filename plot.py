"""
plot.py: the RL comparison figure. Reads the metrics.jsonl of several runs of train_grpo.py and draws
one panel per quantity against the RL step, one colour per dtype, like the paper's training curves.

    python plot.py runs/fp16 runs/bf16 runs/fp32 --out figures/rl_default.png

Each run's folder holds args.json (its flags, with the dtype) and metrics.jsonl (one row per step).
It also prints, per run, the figures the README's tables quote (results, and medians of the timings).
Per-step values are noisy at this batch size: thin lines are the raw values, thick ones a moving
average over --smooth steps.
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


def main(argv=None):
    p = argparse.ArgumentParser(description="plot several train_grpo.py runs, one colour per dtype")
    p.add_argument("runs", nargs="+", help="run folders (--out of train_grpo.py)")
    p.add_argument("--out", default="figures/rl.png", help="PNG to write")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window, in steps")
    p.add_argument("--title", default=None)
    p.error = fail  # argparse would add a usage block
    args = p.parse_args(argv)
    if args.smooth < 1:
        fail("--smooth must be at least 1")
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
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, args.out)  # never a half-written PNG
    print(f"written {args.out}")


if __name__ == "__main__":
    main()
