"""
train_grpo.py: RL fine-tuning (GRPO) of a small GPT whose rollouts come from the real vLLM engine,
with one --dtype flag that switches both sides, trainer and engine, between fp16, bf16 and fp32.

    python train_grpo.py --dtype fp16     # or bf16, fp32: same data, same seed, same starting weights
    python train_grpo.py --probe          # no training: the offline mismatch of every dtype pairing

The run, top to bottom:
  1. warm start: supervised training on worked solutions (bf16 autocast, float32 master weights),
     cached under --warmstart-dir, so every dtype starts from bit-identical float32 weights;
  2. start the vLLM engine on those weights in the run's dtype;
  3. each step: the engine samples a group of responses per prompt (mu = its log-probs), the
     trainer re-scores them in the run's dtype (pi), we log how far mu is from pi, take one GRPO
     step through the GradScaler, and push the new weights into the engine in place.

What it teaches: the engine and the trainer compute "the same" probabilities with different kernels.
In bf16 (7 mantissa bits) they disagree enough to bias the policy gradient; in fp16 (10 bits, with
loss scaling for its narrow range) the disagreement shrinks many times; in fp32 it all but vanishes.
"""
import argparse
import fcntl
import hashlib
import json
import math
import os
import random
import signal
import sys
import time

import torch

import task
from model import GPT, GPTConfig, hf_named_tensors, load_hf, save_hf, token_logprobs
from precision import get_precision, machine, machine_line, mismatch_metrics
from rollout import generate, require_vllm, start_engine, sync_weights  # vllm itself is imported lazily


# ---------------------------------------------------------------------------------------------------
# The GRPO loss, by hand

def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-6):
    """rewards (N,) laid out as N/G groups of G samples of one prompt -> advantages (N,).
    A = (r - mean of its group) / (std of its group + eps); Dr. GRPO drops the division. A group whose
    samples all got the same reward gets A = 0 everywhere: it carries no learning signal."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logp, old_logp, mu_logp, adv, mask, clip_eps=0.2, correction="none", cap=2.0,
              ref_logp=None, kl_coef=0.0, n_tokens=None):
    """All per-token tensors are (N, T), aligned with the predicted token; mask is 1 on response tokens.
      logp      trainer log-probs with gradient (pi_theta)
      old_logp  trainer log-probs before this update, no gradient (pi_old, the run's dtype)
      mu_logp   the engine's log-probs of the same tokens (mu, the policy that actually sampled)
    PPO: ratio = pi_theta / pi_old, loss = -min(ratio A, clip(ratio, 1 - eps, 1 + eps) A).
    With one optimizer step per rollout batch (the default) pi_old is pi_theta itself at the moment of
    the step: ratio = 1, clipping is inactive, and the gradient is the plain policy gradient of pi.
    But the samples came from mu, not pi, so the true importance weight of the update is pi / mu: it
    differs from 1 by the training-inference mismatch alone, and vanilla GRPO ignores it. That is the
    bias the dtype controls. The corrections the paper compares FP16 against reweight by it:
      none  the vanilla baseline
      tis   token-level truncated importance sampling: weight each token by min(pi_old / mu, cap)
      mis   sequence-level masked importance sampling: weight a sequence by rho = prod(pi_old / mu)
            over its tokens, and drop it (weight 0) when rho > cap
    Normalisation: token-level mean over all response tokens of the batch (DAPO), so long responses
    are not down-weighted per token; n_tokens, when given, is that count for a batch of which only
    some sequences were passed in. Optional k3 KL penalty to a reference policy (ref_logp)."""
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    log_w = (old_logp - mu_logp).detach() * mask  # log of the token importance weight pi_old / mu
    if correction == "tis":
        per_token = per_token * torch.exp(log_w).clamp(max=cap)
    elif correction == "mis":
        rho = torch.exp(log_w.sum(dim=1, keepdim=True))
        per_token = per_token * torch.where(rho <= cap, rho, torch.zeros_like(rho))
    elif correction != "none":
        raise ValueError(f"unknown correction {correction!r}")
    if kl_coef:
        log_r = ref_logp.detach() - logp  # k3 estimator of KL(pi || ref): r - 1 - log r, r = ref / pi
        per_token = per_token + kl_coef * (torch.exp(log_r) - 1 - log_r)
    return (per_token * mask).sum() / (mask.sum() if n_tokens is None else n_tokens).clamp(min=1)


def optimizer_step(model, opt, scaler, loss, max_grad_norm):
    """Scaled backward, unscale, clip, step, update. Returns (grad norm, skipped).
    fp16: the loss is multiplied by the scale so small gradients survive fp16's range; unscale_ divides
    the float32 master gradients back before clipping, so the clip sees true norms; scaler.step skips
    the optimizer step if any gradient is inf/nan, and update() then halves the scale.
    bf16/fp32: the scaler is disabled and these same lines pass straight through; a non-finite
    gradient there is never 'expected', so we skip the step (weights untouched) and report it."""
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    scale_before = scaler.get_scale()
    if scaler.is_enabled() or math.isfinite(grad_norm):
        scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale_before if scaler.is_enabled() else not math.isfinite(grad_norm)
    return grad_norm, skipped


# ---------------------------------------------------------------------------------------------------
# Batches: from token-id lists to padded tensors

def pack(prompts, responses, device, logprobs=None):
    """Right-padded (N, T) token ids, a (N, T-1) mask that is 1 where a response token is predicted
    (the shape token_logprobs returns), and the engine's log-probs laid out the same way (zeros if
    none are given)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), task.EOS_ID, dtype=torch.long)
    mask, mu = torch.zeros(len(seqs), T - 1), torch.zeros(len(seqs), T - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        idx[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1:len(p) - 1 + len(r)] = 1.0
        if logprobs is not None:
            mu[i, len(p) - 1:len(p) - 1 + len(r)] = torch.tensor(logprobs[i])
    return idx.to(device), mask.to(device), mu.to(device)


def problems_for_step(args, step, n):
    """The prompts of one step depend on (seed, step) alone: repeatable runs, exact resume."""
    gen = args.train_problems(f"{args.seed}-{step}")
    return [next(gen) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------
# Warm start: supervised fine-tuning on worked solutions, cached

def warm_start(args, cfg, device):
    """Returns the checkpoint directory of the warm-started model, training it only if no cached copy
    exists for exactly these settings (the key hashes everything that determines the weights)."""
    key_src = json.dumps({"cfg": cfg.__dict__, "n_items": args.n_items, "seed": args.seed, "steps": args.sft_steps,
                          "lr": args.sft_lr, "batch": args.sft_batch, "noise": args.sft_noise}, sort_keys=True)
    ckpt = os.path.join(args.warmstart_dir, hashlib.sha256(key_src.encode()).hexdigest()[:12])
    if os.path.isfile(os.path.join(ckpt, "config.json")):  # save_hf writes it last: present = complete
        print(f"warm start: reusing {ckpt}")
        return ckpt, None
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    # How base models are trained: float32 master weights, bf16 autocast for the forward (the gentler
    # mixed precision; RL then uses the run's dtype throughout). bf16 needs no loss scaling.
    forward = get_precision("bf16", device).autocast_forward(model)
    t0, losses = time.time(), []
    for step in range(args.sft_steps):
        lr = args.sft_lr * min(1.0, (step + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * step / args.sft_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = problems_for_step(args, f"sft-{step}", args.sft_batch)
        noise_rng = random.Random(f"noise-{args.seed}-{step}")
        answers = [task.answer_ids(task.noisy_answer(a, noise_rng, args.sft_noise)) for _, a in batch]
        idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch], answers, device)
        loss = -(token_logprobs(forward, idx) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.sft_steps - 1:
            print(f"warm start {step:4d}/{args.sft_steps} | loss {loss.item():.4f} | {time.time() - t0:.0f}s", flush=True)
    save_hf(model, ckpt)
    return ckpt, losses


# ---------------------------------------------------------------------------------------------------
# Evaluation: sampled accuracy at temperature 1 on held-out problems, with the engine

def evaluate(llm, args, step):
    torch.manual_seed(args.seed * 1_000_003 + 999_983 + step)  # the engine samples from this generator
    probs = args.eval_problems
    samples = generate(llm, [task.prompt_ids(p) for p, _ in probs], 1, args.max_new_tokens, task.EOS_ID)
    return sum(task.reward(s.response_ids, a) for s, (_, a) in zip(samples, probs)) / len(probs)


# ---------------------------------------------------------------------------------------------------
# The RL loop

def model_config(args):
    return GPTConfig(vocab_size=task.VOCAB_SIZE, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     n_hidden=args.n_hidden, max_seq_len=args.max_seq_len, bos_id=task.BOS_ID, eos_id=task.EOS_ID)


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


def save_checkpoint(path, step, model, opt, scaler, acc0):
    """Everything a resumed run needs: weights, optimizer and scaler states, the RNG, the next step.
    The data and the engine's sampling of step s depend only on (seed, s), so this is enough for a
    resumed run to redo exactly the steps an uninterrupted run would have done."""
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                "torch_rng": torch.get_rng_state(), "acc0": acc0}, path + ".tmp")
    os.replace(path + ".tmp", path)


def learning_rate(args, step):
    """Linear warm-up: Adam's first updates move every weight by ~lr whatever the gradient's size (its
    variance estimate starts from one noisy sample), enough to knock a tuned model over. Then, with
    --lr-schedule cosine, a decay to a tenth of --lr: RL gradients stay noisy, and a smaller late step
    lets the policy settle instead of jittering around the optimum."""
    warm = min(1.0, (step + 1) / args.warmup_steps)
    if args.lr_schedule == "constant":
        return args.lr * warm
    progress = max(0.0, step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args, llm=None):
    """The whole run. `llm`: an already running engine of the run's dtype to reuse (the tests share one
    per session); the starting weights are synced into it, which is the same as starting it on them."""
    # One run per output folder: a second one would interleave metrics and overwrite checkpoints. The
    # kernel also drops the lock if this process dies.
    os.makedirs(args.out, exist_ok=True)
    lock = open(os.path.join(args.out, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fail(f"--out {args.out} is in use by another run")
    # Ctrl-C / SIGTERM only raise a flag: the run stops at the next step boundary with a checkpoint.
    stop = {}
    handlers = {sig: signal.signal(sig, lambda num, _: stop.setdefault("signal", signal.Signals(num).name))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _train(args, llm, stop)
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        lock.close()


def _train(args, llm, stop):
    require_vllm()
    prec = get_precision(args.dtype)
    device = prec.device
    t_start = time.time()

    ckpt = args.init or warm_start(args, model_config(args), device)[0]
    model = load_hf(ckpt, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    scaler = prec.grad_scaler()
    state_path, metrics_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "metrics.jsonl")
    start_step, acc0 = 0, None
    if args.resume:
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        scaler.load_state_dict(st["scaler"])
        torch.set_rng_state(st["torch_rng"])
        start_step, acc0 = st["step"], st["acc0"]
        print(f"resuming {args.out} at step {start_step}")
    # Keep the metrics of the steps before the checkpoint, drop any after it: no step is ever duplicated.
    history = read_metrics(metrics_path)[:start_step] if args.resume else []
    write_atomic(metrics_path, "".join(json_line(r) for r in history))
    # The run's settings beside its metrics, for plot.py and for whoever reads the folder later.
    settings = {k: v for k, v in vars(args).items() if k not in ("train_problems", "eval_problems")}
    write_atomic(os.path.join(args.out, "args.json"), json.dumps({**settings, "dtype": prec.name,
                                                                    "machine": machine()}, indent=2))

    # The engine must serve the weights the trainer starts from: a resumed checkpoint's, or ours in a
    # caller's engine. For a fresh engine this reloads what it already holds (30 ms, same log-probs).
    llm = llm or start_engine(ckpt, prec.vllm_dtype, args.seed, args.max_seq_len, args.gpu_memory_utilization)
    sync_weights(llm, hf_named_tensors(model), prec.dtype)
    ref_model = load_hf(ckpt, device).eval() if args.kl_coef else None
    G = args.group_size

    if acc0 is None:
        acc0 = evaluate(llm, args, -1)
    print(f"dtype {prec.name} | engine {prec.vllm_dtype} | device {device} | held-out accuracy before RL {acc0:.3f}")

    def halt(step, message):
        """Stop after the last good state is on disk: weights before this step, metrics so far."""
        save_checkpoint(state_path, step, model, opt, scaler, acc0)
        raise SystemExit(f"error: step {step}: {message}; metrics and the checkpoint before this step are in "
                         f"{args.out} (resume with --resume)")

    consecutive_skips = 0
    with open(metrics_path, "a") as mf:
        for step in range(start_step, args.steps):
            for g in opt.param_groups:
                g["lr"] = learning_rate(args, step)

            # 1. rollout: the engine samples G responses per prompt, with its own log-probs (mu)
            t0 = time.perf_counter()
            probs = problems_for_step(args, step, args.batch_size)
            torch.manual_seed(args.seed * 1_000_003 + step)  # the in-process engine samples from this generator
            samples = generate(llm, [task.prompt_ids(p) for p, _ in probs], G, args.max_new_tokens, task.EOS_ID)
            answers = [a for _, a in probs for _ in range(G)]
            rewards = torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)])
            t1 = time.perf_counter()

            # 2. the trainer scores the same tokens in the run's dtype (pi, before the update)
            idx, mask, mu_logp = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device,
                                      [s.logprobs for s in samples])
            with torch.no_grad():
                old_logp = token_logprobs(prec.forward(model), idx)
                ref_logp = token_logprobs(prec.forward(ref_model), idx) if ref_model is not None else None
            for name, t in (("engine log-prob", mu_logp), ("trainer log-prob", old_logp)):
                if not torch.isfinite(t[mask.bool()]).all():
                    halt(step, f"non-finite {name}")
            mm = mismatch_metrics(mu_logp, old_logp, mask)
            t2 = time.perf_counter()

            # 3. one GRPO step (or --updates-per-batch) through the GradScaler
            adv = group_advantages(rewards, G, scale_by_std=not args.no_std).to(device)
            # A sequence with A = 0 (every group whose samples all agree) adds exactly 0 to the loss and
            # its gradient: leave it out of the forward and backward, but keep all response tokens in
            # the token-mean's denominator. Same gradient, less work (half of it near 90 % reward).
            keep = adv != 0
            if args.kl_coef or not keep.any():  # the KL term counts every token; a batch of A = 0 still steps
                keep = torch.ones_like(keep)
            for _ in range(args.updates_per_batch):
                logp = token_logprobs(prec.forward(model), idx[keep])
                loss = grpo_loss(logp, old_logp[keep], mu_logp[keep], adv[keep], mask[keep], args.clip_eps,
                                 args.correction, args.is_cap, ref_logp[keep] if args.kl_coef else None,
                                 args.kl_coef, n_tokens=mask.sum())
                if not torch.isfinite(loss):
                    halt(step, f"non-finite loss ({loss.item()})")
                grad_norm, skipped = optimizer_step(model, opt, scaler, loss, args.max_grad_norm)
            t3 = time.perf_counter()

            # 4. push the new weights into the engine, in place
            t_sync = sync_weights(llm, hf_named_tensors(model), prec.dtype)

            n_tokens = sum(len(s.response_ids) for s in samples)
            rec = {"step": step, "reward_mean": rewards.mean().item(), "loss": loss.item(),
                   "response_len_mean": n_tokens / len(samples),
                   "truncated_frac": sum(not s.finished for s in samples) / len(samples),
                   **mm, "grad_norm": grad_norm, "loss_scale": scaler.get_scale(), "step_skipped": bool(skipped),
                   "time_rollout_s": t1 - t0, "time_logprob_s": t2 - t1, "time_train_s": t3 - t2,
                   "time_sync_s": t_sync, "rollout_tokens_per_s": n_tokens / (t1 - t0)}
            if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
                rec["eval_accuracy"] = evaluate(llm, args, step)
            rec["time_step_s"] = time.perf_counter() - t0
            history.append(rec)
            mf.write(json_line(rec))
            mf.flush()
            print(f"step {step:4d} | reward {rec['reward_mean']:.3f} | k3 {rec['mismatch_k3']:.2e} "
                  f"| max|dp| {rec['mismatch_prob_abs_max']:.2e} | gnorm {grad_norm:.3f} "
                  f"| scale {rec['loss_scale']:.0f}{' SKIP' if skipped else ''} | {rec['time_step_s']:.2f}s "
                  f"(sync {t_sync * 1000:.0f}ms, {rec['rollout_tokens_per_s']:.0f} tok/s)"
                  + (f" | eval {rec['eval_accuracy']:.3f}" if "eval_accuracy" in rec else ""), flush=True)

            consecutive_skips = consecutive_skips + 1 if skipped else 0
            if skipped and not scaler.is_enabled():
                halt(step + 1, "non-finite gradient (the step was skipped; only fp16 expects that)")
            if consecutive_skips > args.max_skips:
                halt(step + 1, f"{consecutive_skips} consecutive fp16 steps skipped for inf/nan gradients "
                               f"(--max-skips {args.max_skips})")
            if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps or stop:
                save_checkpoint(state_path, step + 1, model, opt, scaler, acc0)
            if stop:
                print(f"{stop['signal']}: stopped after step {step}; checkpoint and metrics are in {args.out}; "
                      f"continue with --resume")
                return None

    save_hf(model, os.path.join(args.out, "hf"))
    last = history[-10:]
    summary = {"dtype": prec.name, "steps": args.steps, "eval_accuracy_before": acc0,
               "eval_accuracy_after": history[-1].get("eval_accuracy"),
               "reward_mean_last10": sum(r["reward_mean"] for r in last) / len(last),
               "mismatch_k3_mean": sum(r["mismatch_k3"] for r in history) / len(history),
               "steps_skipped": sum(r["step_skipped"] for r in history),
               "wall_s": time.time() - t_start, "machine": machine_line(machine())}
    write_atomic(os.path.join(args.out, "summary.json"), json.dumps(summary, indent=2))
    print("summary: " + " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary


def make_parser(description):
    """The flags of a run; probe.py adds its own to the same parser (same task, model, warm start)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="fp16", help="fp16 | bf16 | fp32: the trainer's and the engine's dtype")
    p.add_argument("--out", default=None, help="output folder (default runs/<dtype>)")
    p.add_argument("--warmstart-dir", default="runs/warmstart", help="cache of warm-start checkpoints")
    p.add_argument("--seed", type=int, default=0)
    # the task
    p.add_argument("--n-items", type=int, default=12, help="digits to sort: the response is 2*n tokens")
    p.add_argument("--n-eval", type=int, default=256, help="held-out problems")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: 2*n-items + 8")
    # the model
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-hidden", type=int, default=384)
    p.add_argument("--max-seq-len", type=int, default=128)
    # warm start
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-noise", type=float, default=0.005, help="chance each digit of a training solution is wrong")
    # GRPO
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (G >= 2)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=5, help="linear learning-rate warm-up")
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"], help="after the warm-up")
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--updates-per-batch", type=int, default=1, help="optimizer steps per rollout batch")
    p.add_argument("--no-std", action="store_true", help="Dr. GRPO: do not divide advantages by the group std")
    p.add_argument("--correction", default="none", choices=["none", "tis", "mis"])
    p.add_argument("--is-cap", type=float, default=2.0, help="cap C of tis / mis")
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the warm start (0 = off)")
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=10, help="steps between resumable checkpoints")
    p.add_argument("--max-skips", type=int, default=10, help="stop after more consecutive fp16 steps skipped")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--init", default=None, help="start RL from this checkpoint folder instead of the warm start")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="engine's share of GPU memory (GPU only)")
    p.error = lambda message: fail(message)  # one line, exit 2 (argparse would add a usage block)
    return p


def get_args(argv=None):
    return finish_args(make_parser(__doc__.split("\n")[1]).parse_args(argv), training=True)


def finish_args(args, training, json_out=None):
    """Fill in the derived settings, refuse bad input, then make the problem generators."""
    args.max_new_tokens = args.max_new_tokens or 2 * args.n_items + 8
    args.out = args.out or os.path.join("runs", str(args.dtype))
    check_args(args, training, json_out)
    args.train_problems, args.eval_problems = task.make_splits(args.seed, args.n_items, args.n_eval)
    return args


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def check_args(args, training, json_out):
    """Refuse bad input before any model is built, engine started or file written."""
    for flag in ("n_items", "n_eval", "max_new_tokens", "n_layer", "n_head", "n_embd", "n_hidden", "max_seq_len",
                 "sft_steps", "sft_batch", "steps", "batch_size", "warmup_steps", "updates_per_batch", "eval_every",
                 "ckpt_every", "lr", "sft_lr", "max_grad_norm", "clip_eps", "is_cap"):
        if not getattr(args, flag) > 0:
            fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    try:
        get_precision(args.dtype)
        model_config(args)
    except ValueError as e:
        fail(str(e).replace("n_embd/n_head", "--n-embd/--n-head"))
    if args.group_size < 2:
        fail(f"--group-size must be at least 2 (GRPO compares samples within a group), got {args.group_size}")
    if not 0 <= args.sft_noise < 1 or args.kl_coef < 0 or args.max_skips < 0 or not 0 < args.gpu_memory_utilization <= 1:
        fail("--sft-noise must be in [0, 1), --kl-coef and --max-skips >= 0, --gpu-memory-utilization in (0, 1]")
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
    else:  # probe.py writes nothing but the warm-start cache and its --json
        folders = [args.warmstart_dir] + ([os.path.dirname(os.path.abspath(json_out))] if json_out else [])
    has_run = training and os.path.isfile(os.path.join(args.out, "metrics.jsonl"))
    if args.resume and not os.path.isfile(os.path.join(args.out, "checkpoint.pt")):
        fail(f"--resume: {args.out} has no checkpoint.pt to resume from")
    if has_run and not args.resume:
        fail(f"--out {args.out} already holds a run: pass --resume to continue it, or choose another --out")
    for folder in folders:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, ".write-test"), "w"):
                pass
            os.remove(os.path.join(folder, ".write-test"))
        except OSError as e:
            fail(f"cannot write to {folder}: {e.strerror}")


if __name__ == "__main__":
    train(get_args())
