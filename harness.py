"""
harness.py: a run's folder, kept out of train_grpo.py's way: one run per folder (a lock), Ctrl-C and
SIGTERM stopping at a step boundary, checkpoints and an exact --resume, files written atomically,
metrics as strict JSON, numerical stops, and refusing bad input before anything starts.

What it teaches: nothing about precision, on purpose. Every behaviour here is tested
(tests/test_hardening.py), so train_grpo.py can read as the algorithm alone.
"""
import argparse
import fcntl
import json
import math
import os
import random
import signal
import sys
from contextlib import contextmanager

import torch

import task
from model import load_hf, save_hf
from precision import machine, machine_line


@contextmanager
def run_folder(out):
    """Hold a lock on --out for the run (the kernel drops it if the process dies: two runs never
    interleave metrics), and turn SIGINT/SIGTERM into a flag the loop checks at each step boundary."""
    os.makedirs(out, exist_ok=True)
    lock = open(os.path.join(out, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"--out {out} is in use by another run")
    stop = {}
    handlers = {sig: signal.signal(sig, lambda num, _: stop.setdefault("signal", signal.Signals(num).name))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        lock.close()


class Run:
    """A run's files in --out: metrics.jsonl (a row per step), checkpoint.pt (what --resume needs),
    args.json, and at the end hf/ and summary.json. Every file is written under a temporary name and
    renamed, so a kill never leaves half a file."""

    def __init__(self, args, prec, model, opt, scaler):
        self.args, self.prec, self.model, self.opt, self.scaler = args, prec, model, opt, scaler
        self.ckpt_path, self.metrics_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "metrics.jsonl")
        self.start_step, self.acc0, self.skips = 0, None, 0
        if args.resume:
            st = torch.load(self.ckpt_path, weights_only=False)
            for obj, key in ((model, "model"), (opt, "opt"), (scaler, "scaler")):
                obj.load_state_dict(st[key])
            torch.set_rng_state(st["torch_rng"])
            self.start_step, self.acc0 = st["step"], st["acc0"]
            print(f"resuming {args.out} at step {self.start_step}")
        # Keep the metrics of the steps before the checkpoint, drop any after it: no step is ever duplicated.
        self.history = read_metrics(self.metrics_path)[:self.start_step] if args.resume else []
        write_atomic(self.metrics_path, "".join(json_line(r) for r in self.history))
        settings = {k: v for k, v in vars(args).items() if k not in ("train_problems", "eval_problems")}
        write_atomic(os.path.join(args.out, "args.json"),
                     json.dumps({**settings, "dtype": prec.name, "machine": machine()}, indent=2))

    def save(self, step):
        """Everything a resumed run needs: weights, optimizer and scaler states, the RNG, the next step.
        The data and the engine's sampling of step s depend only on (seed, s), so this is enough for a
        resumed run to redo exactly the steps an uninterrupted run would have done."""
        torch.save({"step": step, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "scaler": self.scaler.state_dict(), "torch_rng": torch.get_rng_state(), "acc0": self.acc0},
                   self.ckpt_path + ".tmp")
        os.replace(self.ckpt_path + ".tmp", self.ckpt_path)

    def halt(self, step, message):
        """Stop after the last good state is on disk: weights before this step, metrics so far."""
        self.save(step)
        raise SystemExit(f"error: step {step}: {message}; metrics and the checkpoint before this step are in "
                         f"{self.args.out} (resume with --resume)")

    def check_finite(self, step, batch):
        mask = batch["mask"].bool()
        for name, key in (("engine log-prob", "mu_logp"), ("trainer log-prob", "pi_logp")):
            if key in batch and not torch.isfinite(batch[key][mask]).all():
                self.halt(step, f"non-finite {name}")

    def record(self, step, rec, stop):
        """Append the step's row, print it, stop on too many skipped steps, checkpoint when due."""
        self.history.append(rec)
        with open(self.metrics_path, "a") as f:
            f.write(json_line(rec))
        print(f"step {step:4d} | reward {rec['reward_mean']:.3f} | k3 {rec['mismatch_k3']:.2e} "
              f"| max|dp| {rec['mismatch_prob_abs_max']:.2e} | gnorm {rec['grad_norm']:.3f} "
              f"| scale {rec['loss_scale']:.0f}{' SKIP' if rec['step_skipped'] else ''} | {rec['time_step_s']:.2f}s "
              f"(sync {rec['time_sync_s'] * 1000:.0f}ms, {rec['rollout_tokens_per_s']:.0f} tok/s)"
              + (f" | eval {rec['eval_accuracy']:.3f}" if "eval_accuracy" in rec else ""), flush=True)
        self.skips = self.skips + 1 if rec["step_skipped"] else 0
        if rec["step_skipped"] and not self.scaler.is_enabled():
            self.halt(step + 1, "non-finite gradient (the step was skipped; only fp16 expects that)")
        if self.skips > self.args.max_skips:
            self.halt(step + 1, f"{self.skips} consecutive fp16 steps skipped for inf/nan gradients "
                                f"(--max-skips {self.args.max_skips})")
        if (step + 1) % self.args.ckpt_every == 0 or step + 1 == self.args.steps or stop:
            self.save(step + 1)

    def finish(self):
        save_hf(self.model, os.path.join(self.args.out, "hf"))
        h, last = self.history, self.history[-10:]
        summary = {"dtype": self.prec.name, "steps": self.args.steps, "eval_accuracy_before": self.acc0,
                   "eval_accuracy_after": h[-1].get("eval_accuracy"),
                   "reward_mean_last10": sum(r["reward_mean"] for r in last) / len(last),
                   "mismatch_k3_mean": sum(r["mismatch_k3"] for r in h) / len(h),
                   "steps_skipped": sum(bool(r["step_skipped"]) for r in h), "machine": machine_line(machine())}
        write_atomic(os.path.join(self.args.out, "summary.json"), json.dumps(summary, indent=2))
        print("summary: " + " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
        return summary


def write_atomic(path, text):
    """Write to a temporary name, then rename: a crash or a kill never leaves a half-written file."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def json_line(rec):
    """One metrics row as strict JSON: a non-finite number (an fp16 step's inf gradient norm) is not
    valid JSON for other readers, so it is written as null and its key listed under "nonfinite"."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    rec = {**{k: None if k in bad else v for k, v in rec.items()}, **({"nonfinite": bad} if bad else {})}
    return json.dumps(rec, allow_nan=False) + "\n"


def read_metrics(path):
    rows = []
    if os.path.isfile(path):
        for line in open(path):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a hard kill: that step is redone
                break
    return rows


def number(kind, low=0.0, low_ok=False, high=None):
    """An argparse type: a `kind` number above `low` (or equal to it if low_ok), below `high`."""
    def parse(text):
        value = kind(text)  # a ValueError becomes argparse's "invalid float value"
        if value < low or (value == low and not low_ok) or (high is not None and value > high):
            bound = f">= {low}" if low_ok else f"> {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and <= {high}" if high else "") + f", got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args, training, json_out):
    """What argparse cannot express, refused before any model is built, engine started or file written
    (train_grpo.finish_args has already checked the dtype and the model's shape)."""
    longest = len(task.prompt_ids(task.make_problem(random.Random(0), args.n_items)[0])) + args.max_new_tokens
    if longest > args.max_seq_len:
        fail(f"--max-seq-len {args.max_seq_len} is too short for a prompt plus --max-new-tokens ({longest} tokens)")
    if args.init:
        try:
            load_hf(args.init)
        except ValueError as e:
            fail(f"--init: {e}")
    if training:
        folders = [args.out, args.warmstart_dir]
        if args.resume and not os.path.isfile(os.path.join(args.out, "checkpoint.pt")):
            fail(f"--resume: {args.out} has no checkpoint.pt to resume from")
        if os.path.isfile(os.path.join(args.out, "metrics.jsonl")) and not args.resume:
            fail(f"--out {args.out} already holds a run: pass --resume to continue it, or choose another --out")
    else:  # probe.py writes nothing but the warm-start cache and its --json
        folders = [args.warmstart_dir] + ([os.path.dirname(os.path.abspath(json_out))] if json_out else [])
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, ".write-test"), "w"):
                pass
            os.remove(os.path.join(folder, ".write-test"))
        except OSError as e:
            fail(f"cannot write to {folder}: {e.strerror}")


