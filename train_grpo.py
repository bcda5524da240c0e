"""
train_grpo.py: RL fine-tuning (GRPO) of a small GPT whose rollouts come from the real vLLM
engine; one --dtype flag switches trainer and engine between fp16, bf16 and fp32.

    python train_grpo.py --dtype fp16     # or bf16, fp32: same data, seed and start

From a warm start (warm_start.py), each step is five calls:
  1. rollout  the engine samples G responses per prompt, with its log-probs mu
  2. score    the trainer's log-probs pi of the same tokens
  3. update   the GRPO loss, a backward through the GradScaler, a step (grpo.py)
  4. sync     the new weights into the running engine, in place
  5. save     a strict-JSON metrics row, then a checkpoint

It teaches: engine and trainer compute "the same" probabilities with different kernels; in
bf16 (7 mantissa bits) they disagree enough to bias the gradient; fp16 (10) shrinks that.
Left out: distributed training, an asynchronous engine: neither changes where dtype enters.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import time

import torch

import task
from grpo import ALGORITHMS, CAPS, Batch, Update, group_advantages, grpo_step
from model import (hf_named_tensors, load_hf, pack, read_config, save_hf, token_logprobs,
                   write_atomic)
from precision import DTYPES, get_precision, mismatch_metrics
from rollout import generate, start_engine, sync_weights
from warm_start import model_config, warm_start

WARMUP_STEPS = 5  # linear learning-rate warm-up, then a cosine decay to LR_FLOOR x --lr
LR_FLOOR = 0.1
EVAL_EVERY = 10   # steps between held-out evaluations (and after the last)
MAX_SKIPS = 10    # fp16 steps skipped in a row (inf/nan gradients) before a stop

def rollout(llm, train_batch, args, step, device):
    """Step 1: G responses per prompt from the engine, its log-probs mu, rewards, advantages."""
    t0 = time.perf_counter()
    problems = train_batch(("rl", args.seed, step), args.batch_size)
    # The engine samples from torch's global generator (a per-request seed crashes its CPU
    # sampler): seeded here, samples are a function of (weights, seed, step)
    torch.manual_seed(task.seed_of("rollout", args.seed, step))
    prompts = [task.prompt_ids(p) for p, _ in problems]
    samples = generate(llm, prompts, args.group_size, args.max_new_tokens, task.EOS_ID)
    answers = [a for _, a in problems for _ in range(args.group_size)]
    rewards = torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)])
    columns = [[getattr(s, k) for s in samples] for k in ("prompt_ids", "response_ids")]
    idx, mask, mu_logp = pack(*columns, device, [s.logprobs for s in samples])
    adv = group_advantages(rewards, args.group_size, scale_by_std=not args.dr_grpo)
    seconds, n_tokens = time.perf_counter() - t0, int(mask.sum())
    log = {"reward_mean": rewards.mean().item(),
           "response_len_mean": n_tokens / len(samples),
           "truncated_frac": sum(not s.finished for s in samples) / len(samples),
           "time_rollout_s": seconds, "rollout_tokens_per_s": n_tokens / seconds}
    return Batch(idx, mask, mu_logp, adv.to(device), log)

def score(model, prec, batch):
    """Step 2: the trainer's log-probs pi of the samples, in its dtype, before the update."""
    with torch.no_grad():
        return token_logprobs(prec.logits_fn(model), batch.idx)

def evaluate(llm, eval_problems, args, step):
    """Held-out accuracy, one sample each at temperature 1 by the run's engine: the curve."""
    torch.manual_seed(task.seed_of("eval", args.seed, step))
    prompts = [task.prompt_ids(p) for p, _ in eval_problems]
    samples = generate(llm, prompts, 1, args.max_new_tokens, task.EOS_ID)
    right = [task.reward(s.response_ids, a) for s, (_, a) in zip(samples, eval_problems)]
    return sum(right) / len(eval_problems)

def save_step(out, step, rec, model, opt, scaler):
    """Step 5: the row as strict JSON (non-finite: null, named in "nonfinite"), a checkpoint."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    row = {k: None if k in bad else v for k, v in rec.items()}
    row.update({"nonfinite": bad} if bad else {})
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")
    state = {"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict(),
             "scaler": scaler.state_dict()}
    write_atomic(os.path.join(out, "checkpoint.pt"), lambda tmp: torch.save(state, tmp))
    mismatch = rec["mismatch_logp_abs_mean"]  # mean |log mu - log pi| a token: the figures'
    print(f"step {step:4d} | reward {rec['reward_mean']:.3f} | mismatch {mismatch:.2e} "
          f"| gnorm {rec['grad_norm']:.3f} | scale {rec['loss_scale']:.0f}"
          f"{' SKIP' * rec['step_skipped']} | {rec['time_step_s']:.2f}s "
          f"| eval {rec.get('eval_accuracy', '-')}", flush=True)

def learning_rate(args, step):
    """Linear warm-up (Adam's first steps move each weight by ~lr), then a cosine decay."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    progress = max(0.0, step - WARMUP_STEPS) / max(1, args.steps - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * warm * (LR_FLOOR + (1 - LR_FLOOR) * cosine)

def open_run(args, record):
    """The resume state (or None), and args.json (flags, record); refuses bad ones."""
    path, state = os.path.join(args.out, "checkpoint.pt"), None
    if args.resume:
        try:
            state = torch.load(path, weights_only=False)
            state["step"]
        except Exception as e:  # noqa: BLE001  (a damaged file fails in many ways)
            refuse(f"--resume: {path} is damaged ({type(e).__name__}: {e})".splitlines()[0])
    try:
        os.makedirs(args.out, exist_ok=True)
        info = json.dumps({**vars(args), **(record or {})}, indent=2)
        write_atomic(os.path.join(args.out, "args.json"), info)
    except OSError as e:
        refuse(f"--out {args.out} cannot be written: {e.strerror}")
    return state

def resume(out, state, model, opt, scaler):  # metrics.jsonl cut to the state: no step twice
    for part, key in ((model, "model"), (opt, "opt"), (scaler, "scaler")):
        part.load_state_dict(state[key])
    path = os.path.join(out, "metrics.jsonl")  # a row is written before its checkpoint
    with open(path) as f:
        write_atomic(path, "".join(f.readlines()[:state["step"]]))
    print(f"resuming {out} at step {state['step']}")
    return state["step"]

def stop(args, step, why):  # a value the run cannot go on from; the last checkpoint is good
    raise SystemExit(f"error: step {step}: {why}; checkpoint and metrics in {args.out}")

def train(args, llm=None, instruments=None, record=None, until=None, engine_options=None):
    """The whole run. llm: an engine to reuse (the tests share one). For experiments/:
    instruments (fields a row), record (args.json's), until (stop early), engine_options."""
    state = open_run(args, record)
    prec = get_precision(args.dtype, args.engine_dtype, args.lm_head, kernels=args.trainer_kernels)
    eval_problems, train_batch = task.make_splits(args.seed, args.n_items, task.N_EVAL)
    cfg = model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head, args.n_embd)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, prec.device)
    model = load_hf(ckpt, prec.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    scaler = prec.grad_scaler()
    update = Update(args.algorithm, args.is_cap, args.behavior_logp == "engine", args.dr_grpo,
                    args.max_new_tokens, args.minibatches, args.seed)
    start = resume(args.out, state, model, opt, scaler) if state else 0
    if llm is None:
        llm = start_engine(ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32,
                           **(engine_options or {}))
    sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)  # the trainer's weights
    acc0 = evaluate(llm, eval_problems, args, -1) if start == 0 else None
    print(f"trainer {args.dtype} ({prec.kernels}'s kernels) | engine {prec.vllm_dtype} | LM "
          f"head {'fp32' if prec.head_fp32 else args.dtype} | held-out before RL {acc0}")
    skips = 0
    for step in range(start, until or args.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(args, step)
        batch = rollout(llm, train_batch, args, step, prec.device)      # 1. sample (mu)
        t1 = time.perf_counter()
        pi = score(model, prec, batch)                                  # 2. pi
        t2 = time.perf_counter()
        if not torch.isfinite(torch.stack([batch.mu_logp, pi])[:, batch.mask.bool()]).all():
            stop(args, step, "non-finite log-prob (engine or trainer)")
        measured = instruments.step(model, prec, batch, pi) if instruments else {}
        stats = grpo_step(model, opt, scaler, prec, batch, pi, update, step, instruments)  # 3.
        # fp16 skips a non-finite gradient (the GradScaler); bf16 and fp32 have no such step
        unscaled_skip = stats["step_skipped"] and not scaler.is_enabled()
        if not math.isfinite(stats["loss"]) or unscaled_skip:
            stop(args, step, f"non-finite loss ({stats['loss']}) or bf16/fp32 gradient")
        t3 = time.perf_counter()
        sync_s = sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)  # 4. sync
        rec = {"step": step, "lr": opt.param_groups[0]["lr"], **batch.log,
               **mismatch_metrics(batch.mu_logp, pi, batch.mask), **measured, **stats,
               "time_logprob_s": t2 - t1, "time_train_s": t3 - t2, "time_sync_s": sync_s}
        if step == 0:
            rec["eval_accuracy_before"] = acc0
        if (step + 1) % EVAL_EVERY == 0 or step == args.steps - 1:
            rec["eval_accuracy"] = evaluate(llm, eval_problems, args, step)
        rec["time_step_s"] = time.perf_counter() - t0
        save_step(args.out, step, rec, model, opt, scaler)              # 5. row, checkpoint
        skips = skips + 1 if stats["step_skipped"] else 0
        if skips > MAX_SKIPS:
            stop(args, step, f"{skips} consecutive fp16 steps skipped for inf/nan gradients")
    save_hf(model, os.path.join(args.out, "hf"))  # the policy, for experiments/heldout.py
    rows = [json.loads(line) for line in open(os.path.join(args.out, "metrics.jsonl"))][-10:]
    last10 = sum(r["reward_mean"] for r in rows) / len(rows)
    print(f"held-out accuracy {rows[-1].get('eval_accuracy')} | last-10 reward {last10:.4f}")

def refuse(message):  # bad input: one line, exit status 2, before any work
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)

def bounded(kind, low, inclusive=True):
    """An argparse type: a finite `kind` number >= low (or > low)."""

    def parse(text):
        value = kind(text)  # a ValueError becomes argparse's "invalid int value"
        above = (value >= low) if inclusive else (value > low)
        if not (math.isfinite(value) and above):
            sign = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"must be {sign} {low}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse

def get_args(argv=None):
    count, positive = bounded(int, 1), bounded(float, 0, inclusive=False)
    p = argparse.ArgumentParser(description="GRPO on the vLLM engine, in one --dtype",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = refuse  # one line: no usage block
    add = p.add_argument
    add("--dtype", default="fp16", choices=DTYPES, help="the trainer's dtype, and the engine's")
    add("--engine-dtype", default=None, choices=DTYPES, help="the engine's; none: --dtype's")
    add("--lm-head", default="same", choices=["same", "fp32"], help="fp32 on both sides")
    add("--trainer-kernels", default="torch", choices=["torch", "engine"], help="engine: vLLM's")
    add("--out", default=None, help="the run's folder; none: runs/<dtype>")
    add("--seed", type=int, default=0, help="task splits, warm start, and the RL phase")
    add("--steps", type=count, default=40)
    add("--batch-size", type=count, default=64, help="prompts per step")
    add("--group-size", type=bounded(int, 2), default=8, help="samples per prompt")
    add("--lr", type=positive, default=3e-4)
    add("--algorithm", default="grpo", choices=ALGORITHMS, help="the loss (grpo.grpo_loss)")
    add("--is-cap", type=positive, default=None, help="cap C; none: the algorithm's (CAPS)")
    add("--behavior-logp", default="trainer", choices=["trainer", "engine"], help="pi_old's")
    add("--dr-grpo", action="store_true", help="Dr. GRPO: no std; sums over the budget")
    add("--minibatches", type=count, default=1, help="optimizer steps per rollout batch")
    add("--n-items", type=count, default=12, help="digits to sort: responses of 2n tokens")
    add("--max-new-tokens", type=count, default=None, help="none: 2 x --n-items + 8")
    for flag, default in (("--n-layer", 4), ("--n-head", 4), ("--n-embd", 128)):  # the GPT
        add(flag, type=count, default=default)
    add("--resume", action="store_true", help="continue the run in --out")
    add("--init", default=None, help="a checkpoint folder to start from, not the warm start")
    args = p.parse_args(argv)
    args.engine_dtype = args.engine_dtype or args.dtype
    args.max_new_tokens = args.max_new_tokens or 2 * args.n_items + 8
    args.out = args.out or os.path.join("runs", args.dtype)
    args.is_cap = args.is_cap or CAPS.get(args.algorithm)  # None: no cap
    check(args)
    return args

def check(args):
    """What argparse cannot see. Reads files, writes none."""
    if importlib.util.find_spec("vllm") is None:
        refuse("vLLM is not installed: run `bash setup.sh`")
    try:
        get_precision(args.dtype, args.engine_dtype, args.lm_head, kernels=args.trainer_kernels)
        cfg = model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head,
                           args.n_embd)
        if args.init and read_config(args.init).max_seq_len < cfg.max_seq_len:
            raise ValueError(f"--init {args.init}: its context is shorter than this task's")
    except ValueError as e:
        refuse(str(e).replace("n_embd/n_head", "--n-embd/--n-head"))
    if args.minibatches > args.batch_size * args.group_size:
        refuse(f"--minibatches {args.minibatches}: more than a batch's sequences")
    if args.algorithm == "token-tis" and args.behavior_logp == "engine":  # w counted twice
        refuse("--algorithm token-tis with --behavior-logp engine: the ratio is pi / mu already")
    if args.dr_grpo and args.algorithm == "gspo":
        refuse("--dr-grpo with --algorithm gspo: a sequence's mean or its sum; choose one")
    if args.resume and not os.path.isfile(os.path.join(args.out, "checkpoint.pt")):
        refuse(f"--resume: {args.out} has no checkpoint.pt to resume from")
    if not args.resume and os.path.isfile(os.path.join(args.out, "metrics.jsonl")):
        refuse(f"--out {args.out} holds a run: --resume to continue it, or another --out")

if __name__ == "__main__":
    train(get_args())
