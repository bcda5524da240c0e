"""
train_grpo.py: RL fine-tuning (GRPO) of a small GPT whose rollouts come from the real vLLM
engine; one --dtype flag switches trainer and engine between fp16, bf16 and fp32.

    python train_grpo.py --dtype fp16     # or bf16, fp32: same data, seed and start

A warm start (supervised, cached: every dtype starts from the same float32 weights), the
engine started on it, then each step five calls:
  1. rollout  the engine samples G responses per prompt, with its log-probs mu
  2. score    the trainer's log-probs pi of the same tokens
  3. update   the GRPO loss, a backward through the GradScaler, an optimizer step
  4. sync     the new weights into the running engine, in place
  5. log      a strict-JSON metrics row and a checkpoint

It teaches: engine and trainer compute "the same" probabilities with different kernels. In
bf16 (7 mantissa bits) they disagree enough to bias the policy gradient; fp16 (10 bits,
loss-scaled) shrinks that many times; fp32 all but removes it.
Left out: a value network, a KL penalty (the paper's runs use none), sequence packing,
distributed training, an asynchronous engine: none changes where the dtype enters.
"""
import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import time
from dataclasses import dataclass

import torch

import task
from model import GPT, GPTConfig, hf_named_tensors, load_hf, logprobs_of, save_hf, token_logprobs
from precision import DTYPES, autocast, get_precision, machine, machine_line
from precision import mismatch_metrics, rounding_scale
from rollout import generate, start_engine, sync_weights

# The paper's algorithms (grpo_loss) and each one's cap C on its importance weights, from the
# paper's oat sanity scripts: Token-TIS 2, Seq-MIS 10, PG-Seq-IS none, PG-Seq-MIS 3 (oat
# truncates at C where the paper's MIS, and ours, drops the sequence).
ALGORITHMS = ("grpo", "token-tis", "seq-mis", "pg-seq-is", "pg-seq-mis", "gspo")
CAPS = {"token-tis": 2.0, "seq-mis": 10.0, "pg-seq-mis": 3.0}  # the others: no cap
GSPO_CLIP = (3e-4, 4e-4)  # GSPO's clip range (the GSPO paper's), below and above 1
CLIP_EPS = 0.2            # PPO's clip range
MAX_GRAD_NORM = 1.0
WARMUP_STEPS = 5          # linear learning-rate warm-up, then a cosine decay ...
LR_FLOOR = 0.1            # ... to LR_FLOOR x --lr
EVAL_EVERY = 10           # steps between held-out evaluations (and after the last step)
N_EVAL = 256              # held-out problems
MAX_SKIPS = 10            # consecutive skipped fp16 steps (inf/nan gradients) before a stop
WARMSTART_DIR = "runs/warmstart"  # warm-start checkpoints, keyed by what determines them
SFT_STEPS = 600
SFT_LR = 3e-3
SFT_BATCH = 64
SFT_NOISE = 0.005         # the chance that a solution digit in the warm-start data is wrong

# ---------------------------------------------------------------------------------------------
# The loss, by hand

def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-6):
    """rewards (N,) in groups of G samples of a prompt -> A = (r - group mean) / (group std +
    eps); Dr. GRPO without the division. A group whose samples all agree gets A = 0."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)

def loss_norm(mask, algorithm, dr_grpo, max_new_tokens):
    """(N, 1): how a mini-batch's per-token losses add up, loss = sum_it norm_i loss_it:
      default    1 / response tokens   DAPO's token mean: each token counts once
      gspo       1 / (|y_i| N)         each sequence's mean, then their mean (GSPO)
      --dr-grpo  1 / (budget N)        oat's Dr. GRPO: each sequence's sum over the budget
                                       (--max-new-tokens), not over |y_i|"""
    n_seq = mask.shape[0]
    if dr_grpo:
        return torch.full((n_seq, 1), 1.0 / (n_seq * max_new_tokens))
    if algorithm == "gspo":
        return 1 / (mask.sum(1, keepdim=True).clamp(min=1) * n_seq)
    return torch.full((n_seq, 1), 1.0) / mask.sum().clamp(min=1)

def grpo_loss(logp, old_logp, batch, norm, algorithm="grpo", cap=None, bypass=False):
    """Returns (loss, parts): parts holds what the loss did, for loss_stats.
    logp: pi_theta, the trainer's log-probs with gradient; old_logp: pi_old, fixed at the
    rollout (the trainer's score, or mu itself with bypass); batch: mask, advantages, and mu,
    the engine's log-probs that sampled the tokens. Per-token tensors are (N, T).
    The samples come from mu, the objective from pi: the unbiased gradient is
    E_mu[(pi / mu) A grad log pi]. GRPO drops pi / mu, which differs from 1 by the mismatch
    alone: the bias the dtype controls. With r = pi_theta / pi_old, w = pi_old / mu, C = cap:
      grpo        -min(r A, clip(r, 1 - eps, 1 + eps) A)              PPO-clip, no correction
      token-tis   grpo, each token times min(w_t, C)                  truncated token IS
      seq-mis     grpo, each sequence times prod_t w_t, 0 above C     masked sequence IS
      pg-seq-is   -w A log pi_theta, w = min(prod_t pi_theta / mu, C) plain PG (w detached)
      pg-seq-mis  the same with w = 0 above C                         dropped, not truncated
      gspo        PPO-clip on s = exp(mean_t log r), one ratio per sequence, clip [1-3e-4, 1+4e-4]
    bypass (pi_old = mu, verl's bypass mode): r already is pi_theta / mu, the correction itself.
    token-tis would count it twice (refused by check); seq-mis keeps only its rejection mask,
    1[prod_t pi_theta / mu <= C], pi_theta detached. cap None: no cap."""
    mask, a, mu_logp = batch.mask, batch.adv[:, None], batch.mu_logp
    cap = math.inf if cap is None else cap
    parts = {}
    if algorithm in ("pg-seq-is", "pg-seq-mis"):
        w = torch.exp(((logp.detach() - mu_logp) * mask).sum(1, keepdim=True))
        over = w > cap
        kept = torch.where(over, 0.0, w) if algorithm == "pg-seq-mis" else w.clamp(max=cap)
        per_token = -kept * a * logp
        parts.update(is_weight=w, is_over_cap=over)
    else:
        lo, hi = GSPO_CLIP if algorithm == "gspo" else (CLIP_EPS, CLIP_EPS)
        log_r = logp - old_logp
        if algorithm == "gspo":  # one ratio per sequence: its mean per-token log-ratio
            tokens = mask.sum(1, keepdim=True).clamp(min=1)
            log_r = (log_r * mask).sum(1, keepdim=True) / tokens
        ratio = torch.exp(log_r)
        per_token = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        # The clip binds (no gradient) where it caps the side A pushes toward.
        clipped = torch.where(a > 0, ratio > 1 + hi, ratio < 1 - lo) & (a != 0)
        parts.update(ratio=ratio.detach(), clipped=clipped)
        pi_logp = logp.detach() if bypass else old_logp  # the pi in the weight pi / mu
        if algorithm == "token-tis":
            w = torch.exp((pi_logp - mu_logp) * mask)
            per_token = per_token * w.clamp(max=cap)
            parts.update(is_weight=w, is_over_cap=w > cap)
        elif algorithm == "seq-mis":
            w = torch.exp(((pi_logp - mu_logp) * mask).sum(1, keepdim=True))
            keep = w <= cap
            per_token = per_token * (keep if bypass else torch.where(keep, w, 0.0))
            parts.update(is_weight=w, is_over_cap=~keep)
    # float32 throughout: logp comes from a float32 log_softmax whatever the trainer's dtype,
    # so the sum over ~12,000 tokens carries float32's rounding, not the 16-bit one.
    return (per_token * mask * norm).sum(), parts

def loss_stats(parts, adv, mask, algorithm):
    """What the loss did, on sequences with A != 0: where the clip binds (tokens, by the sign
    of A; sequences); how far pi_theta got from pi_old; the importance weights before the cap
    (per token for token-tis, else per sequence) and the share over it. parts holds every
    mini-batch's rows: a max is the batch's max, a mean counts each row once."""
    a, seqs = adv[:, None], adv != 0
    tokens = mask.bool() & seqs[:, None]
    stats = {}
    if "ratio" in parts:
        clipped = parts["clipped"].expand_as(mask) & tokens
        for sign, side in (("pos", a > 0), ("neg", a < 0)):
            n = (tokens & side).sum().item()
            stats[f"clip_frac_{sign}"] = (clipped & side).sum().item() / max(1, n)
        n_seqs = max(1, seqs.sum().item())
        stats["clip_seq_frac"] = clipped.any(1).sum().item() / n_seqs
        stats["ratio_dev_max"] = ((parts["ratio"] - 1).abs() * mask).max().item()
    if "is_weight" in parts:
        per_token = algorithm == "token-tis"
        rows = tokens if per_token else seqs
        w = parts["is_weight"][rows] if per_token else parts["is_weight"][rows, 0]
        over = parts["is_over_cap"][rows] if per_token else parts["is_over_cap"][rows, 0]
        if w.numel():
            stats.update(is_weight_mean=w.mean().item(), is_weight_max=w.max().item(),
                         is_capped_frac=over.float().mean().item())
    return stats

# ---------------------------------------------------------------------------------------------
# Step 3: the update

def minibatch_rows(n, args, step):
    """n rows in --minibatches near-equal parts, shuffled as oat does (verl's actor does
    not shuffle)."""
    if args.minibatches == 1:
        return [torch.arange(n)]
    g = torch.Generator().manual_seed(task.seed_of("minibatch", args.rl_seed, step))
    return list(torch.randperm(n, generator=g).tensor_split(args.minibatches))

def with_advantage(adv):
    """Rows to run: A = 0 adds exactly 0 to loss and gradient, so skip it in the forward and
    backward (half the work near 90 % reward), not in the normaliser. All, if none has A."""
    has = adv != 0
    return has if has.any() else torch.ones_like(has)

def optimizer_step(model, opt, scaler, loss):
    """Returns (grad norm, skipped). fp16: loss x scale, so small gradients survive; unscale_
    divides the float32 gradients back before the clip; step() skips an inf/nan gradient and
    update() halves the scale (doubles it after clean steps). bf16/fp32: a pass-through; a
    non-finite gradient is never expected there: skipped too, and reported."""
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item()
    scale_before = scaler.get_scale()
    if scaler.is_enabled() or math.isfinite(grad_norm):
        scaler.step(opt)
    scaler.update()
    if scaler.is_enabled():
        return grad_norm, scaler.get_scale() < scale_before
    return grad_norm, not math.isfinite(grad_norm)

def grpo_step(model, opt, scaler, prec, batch, trainer_logp, args, step):
    """Step 3: one optimizer step per mini-batch, pi_old fixed at the rollout: the trainer's
    score, or with --behavior-logp engine the engine's mu (bypass). Returns the stats."""
    bypass = args.behavior_logp == "engine"
    old_logp = batch.mu_logp if bypass else trainer_logp
    steps = []  # (loss, grad norm, skipped, the loss's parts, the rows it ran on)
    for rows in minibatch_rows(len(batch.adv), args, step):
        norm = loss_norm(batch.mask[rows], args.algorithm, args.dr_grpo, args.max_new_tokens)
        keep = with_advantage(batch.adv[rows])
        kept = rows[keep]
        logp = token_logprobs(prec.forward(model), batch.idx[kept])
        loss, what = grpo_loss(logp, old_logp[kept], batch.select(kept), norm[keep],
                               args.algorithm, args.is_cap, bypass)
        if not torch.isfinite(loss):
            stop(args, step, f"non-finite loss ({loss.item()})")
        grad_norm, skipped = optimizer_step(model, opt, scaler, loss)
        if skipped and not scaler.is_enabled():
            stop(args, step, "non-finite gradient (the step was skipped; only fp16 expects it)")
        steps.append((loss.item(), grad_norm, skipped, what, kept))
    losses, norms, skips, parts, kept = zip(*steps)
    rows = torch.cat(kept)
    together = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    stats = loss_stats(together, batch.adv[rows], batch.mask[rows], args.algorithm)
    # One loss and grad norm per optimizer step, on near-equal mini-batches: a plain mean.
    return {"loss": sum(losses) / len(losses), **stats, "grad_norm": sum(norms) / len(norms),
            "step_skipped": any(skips), "loss_scale": scaler.get_scale()}

def learning_rate(args, step):
    """Linear warm-up (Adam's first steps move every weight by ~lr), then a cosine decay to
    LR_FLOOR; per rollout batch, as verl (oat: per optimizer step; the paper: 1e-6 flat)."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    progress = max(0.0, step - WARMUP_STEPS) / max(1, args.steps - WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return args.lr * warm * (LR_FLOOR + (1 - LR_FLOOR) * cosine)

def stop(args, step, why):  # a value the run cannot go on from; the last checkpoint is good
    raise SystemExit(f"error: step {step}: {why}; checkpoint and metrics in {args.out}")

# ---------------------------------------------------------------------------------------------
# Batches, the warm start, the model's shape

@dataclass
class Batch:
    idx: torch.Tensor      # (N, T) prompt + response token ids, right-padded
    mask: torch.Tensor     # (N, T-1) 1 where a response token is predicted
    mu_logp: torch.Tensor  # (N, T-1) the engine's log-prob of each sampled token
    adv: torch.Tensor      # (N,) the group advantages
    log: dict              # the rollout's figures for the metrics row

    def select(self, rows):
        return Batch(self.idx[rows], self.mask[rows], self.mu_logp[rows], self.adv[rows], {})

def pack(prompts, responses, device, logprobs=None):
    """(N, T) right-padded token ids; (N, T-1) mask of the predicted response tokens
    (token_logprobs' shape); the engine's log-probs laid out the same way (or zeros)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), task.EOS_ID, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1)
    mu = torch.zeros(len(seqs), T - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        idx[i, :len(p) + len(r)] = torch.tensor(p + r)
        where = slice(len(p) - 1, len(p) - 1 + len(r))
        mask[i, where] = 1.0
        if logprobs is not None:
            mu[i, where] = torch.tensor(logprobs[i])
    return idx.to(device), mask.to(device), mu.to(device)

def model_config(n_items, max_new_tokens, n_layer=4, n_head=4, n_embd=128):
    """The GPT for this task: the context is a power of two >= 128 and the longest prompt +
    response. ValueError for a head size vLLM cannot serve."""
    prompt = task.prompt_ids(task.make_problem(random.Random(0), n_items)[0])
    longest = len(prompt) + max_new_tokens
    max_seq_len = max(128, 2 ** math.ceil(math.log2(longest)))
    return GPTConfig(vocab_size=task.VOCAB_SIZE, n_layer=n_layer, n_head=n_head,
                     n_embd=n_embd, n_hidden=3 * n_embd, max_seq_len=max_seq_len,
                     bos_id=task.BOS_ID, eos_id=task.EOS_ID)

def warm_start(cfg, n_items, seed, device):
    """The warm start's checkpoint folder, trained unless cached under a key that hashes all
    that sets the weights."""
    key = json.dumps({"cfg": cfg.__dict__, "n_items": n_items, "seed": seed,
                      "steps": SFT_STEPS, "lr": SFT_LR, "batch": SFT_BATCH,
                      "noise": SFT_NOISE}, sort_keys=True)
    ckpt = os.path.join(WARMSTART_DIR, hashlib.sha256(key.encode()).hexdigest()[:12])
    if os.path.isfile(os.path.join(ckpt, "config.json")):  # save_hf writes it last
        print(f"warm start: reusing {ckpt}")
        return ckpt
    _, train_batch = task.make_splits(seed, n_items, N_EVAL)
    torch.manual_seed(task.seed_of("init", seed))
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.95),
                            weight_decay=0.0)
    for step in range(SFT_STEPS):
        warm = min(1.0, (step + 1) / 50)
        for g in opt.param_groups:
            g["lr"] = SFT_LR * warm * (0.5 + 0.5 * math.cos(math.pi * step / SFT_STEPS))
        batch = train_batch(("sft", step), SFT_BATCH)
        noise = random.Random(task.seed_of("noise", seed, step))
        answers = [task.noisy_answer(a, noise, SFT_NOISE) for _, a in batch]
        idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch],
                            [task.answer_ids(a) for a in answers], device)
        # As base models are trained: float32 weights, bf16 matmuls, no loss scaling.
        with autocast("bf16", device):
            loss = -(token_logprobs(model, idx) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == SFT_STEPS - 1:
            print(f"warm start {step:4d}/{SFT_STEPS} | loss {loss.item():.4f}", flush=True)
    save_hf(model, ckpt)
    return ckpt

# ---------------------------------------------------------------------------------------------
# The loop's steps 1, 2 and 5, and the evaluation

def rollout(llm, train_batch, args, step, device):
    """Step 1: G responses per prompt from the engine, its log-probs mu; rewards, advantages."""
    t0 = time.perf_counter()
    problems = train_batch(("rl", args.rl_seed, step), args.batch_size)
    # The engine samples from torch's global generator (a per-request seed crashes its CPU
    # sampler): seeded here, sampling is a function of (weights, seed, step).
    torch.manual_seed(task.seed_of("rollout", args.rl_seed, step))
    prompts = [task.prompt_ids(p) for p, _ in problems]
    samples = generate(llm, prompts, args.group_size, args.max_new_tokens, task.EOS_ID)
    answers = [a for _, a in problems for _ in range(args.group_size)]
    rewards = torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)])
    idx, mask, mu_logp = pack([s.prompt_ids for s in samples],
                              [s.response_ids for s in samples], device,
                              [s.logprobs for s in samples])
    adv = group_advantages(rewards, args.group_size, scale_by_std=not args.dr_grpo)
    seconds, n_tokens = time.perf_counter() - t0, int(mask.sum())
    log = {"reward_mean": rewards.mean().item(),
           "response_len_mean": n_tokens / len(samples),
           "truncated_frac": sum(not s.finished for s in samples) / len(samples),
           "time_rollout_s": seconds, "rollout_tokens_per_s": n_tokens / seconds}
    return Batch(idx, mask, mu_logp, adv.to(device), log)

def score(model, prec, batch):
    """Step 2: the trainer's log-probs of the samples before the update, in its dtype (pi_old,
    unless --behavior-logp engine), and from the same forward the size of what it rounds."""
    seen = {}
    def keep(module, inputs, output):  # the final norm's input and output
        seen.update(resid=inputs[0], hidden=output)
    hook = model.norm.register_forward_hook(keep)
    with torch.no_grad():
        logits = prec.forward(model)(batch.idx[:, :-1])
    hook.remove()
    scale = rounding_scale(logits, seen["resid"], seen["hidden"], batch.mask, model)
    return logprobs_of(logits, batch.idx), scale

def evaluate(llm, eval_problems, args, step):
    """Held-out accuracy, one sample each at temperature 1 by the run's engine: the curve.
    Runs are compared by experiments/probe.py heldout (one fp32 engine, more samples)."""
    torch.manual_seed(task.seed_of("eval", args.rl_seed, step))
    prompts = [task.prompt_ids(p) for p, _ in eval_problems]
    samples = generate(llm, prompts, 1, args.max_new_tokens, task.EOS_ID)
    right = [task.reward(s.response_ids, a) for s, (_, a) in zip(samples, eval_problems)]
    return sum(right) / len(eval_problems)

def log_step(out, step, rec, model, opt, scaler):
    """Step 5: the row as strict JSON (a non-finite value as null, its key under "nonfinite"),
    and the checkpoint: all a resume needs, as step s's data depend on (seed, s) alone."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    row = {k: None if k in bad else v for k, v in rec.items()}
    row.update({"nonfinite": bad} if bad else {})
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")
    state = {"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict(),
             "scaler": scaler.state_dict()}
    path = os.path.join(out, "checkpoint.pt")
    torch.save(state, path + ".tmp")  # binary: write_atomic's tmp-then-rename, by hand
    os.replace(path + ".tmp", path)
    skip = " SKIP" if rec["step_skipped"] else ""
    print(f"step {step:4d} | reward {rec['reward_mean']:.3f} | k3 {rec['mismatch_k3']:.2e} "
          f"| gnorm {rec['grad_norm']:.3f} | scale {rec['loss_scale']:.0f}{skip} "
          f"| {rec['time_step_s']:.2f}s | eval {rec.get('eval_accuracy', '-')}", flush=True)

# ---------------------------------------------------------------------------------------------
# Files: written atomically; a checkpoint every step (12 MB, ~10 ms): a kill loses one step

def resume(out, state, model, opt, scaler):
    """Load the state; cut metrics.jsonl back to its step (and a line cut by a kill): no step
    twice. Returns the step to go on from."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    scaler.load_state_dict(state["scaler"])
    path = os.path.join(out, "metrics.jsonl")
    rows = read_metrics(path)[:state["step"]]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    print(f"resuming {out} at step {state['step']}")
    return state["step"]

def write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # a kill leaves the old file or the new, never half

def read_metrics(path):
    rows = []
    for line in open(path) if os.path.isfile(path) else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a hard kill: that step is redone
            break
    return rows

# ---------------------------------------------------------------------------------------------
# The run

def train(args, llm=None):
    """The whole run. `llm`: a running engine to reuse (the tests share one)."""
    prec = get_precision(args.dtype, args.engine_dtype, args.lm_head,
                         kernels=args.trainer_kernels)
    eval_problems, train_batch = task.make_splits(args.seed, args.n_items, N_EVAL)
    cfg = model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head,
                       args.n_embd)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, prec.device)
    model = load_hf(ckpt, prec.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                            weight_decay=0.0)
    scaler = prec.grad_scaler()
    start = resume(args.out, args.state, model, opt, scaler) if args.state else 0
    if llm is None:
        llm = start_engine(ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32)
    sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)  # the trainer's weights
    acc0 = evaluate(llm, eval_problems, args, -1) if start == 0 else None
    head = "fp32" if prec.head_fp32 else args.dtype
    kernels = " on the engine's kernels" if prec.kernels == "engine" else ""
    print(f"trainer {args.dtype}{kernels} | engine {prec.vllm_dtype} | LM head {head} | "
          f"{machine_line(machine())} | held-out accuracy before RL {acc0}")
    skips = 0
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(args, step)
        batch = rollout(llm, train_batch, args, step, prec.device)     # 1. sample (mu)
        t1 = time.perf_counter()
        trainer_logp, scale = score(model, prec, batch)                  # 2. pi
        t2 = time.perf_counter()
        both = torch.stack([batch.mu_logp, trainer_logp])[:, batch.mask.bool()]
        if not torch.isfinite(both).all():
            stop(args, step, "non-finite log-prob (engine or trainer)")
        stats = grpo_step(model, opt, scaler, prec, batch, trainer_logp, args, step)  # 3.
        t3 = time.perf_counter()
        sync_s = sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)    # 4. sync
        rec = {"step": step, "lr": opt.param_groups[0]["lr"], **batch.log,
               **mismatch_metrics(batch.mu_logp, trainer_logp, batch.mask), **scale,
               **stats, "time_logprob_s": t2 - t1, "time_train_s": t3 - t2,
               "time_sync_s": sync_s}
        if step == 0:
            rec["eval_accuracy_before"] = acc0
        if (step + 1) % EVAL_EVERY == 0 or step == args.steps - 1:
            rec["eval_accuracy"] = evaluate(llm, eval_problems, args, step)
        rec["time_step_s"] = time.perf_counter() - t0
        log_step(args.out, step, rec, model, opt, scaler)                # 5. log
        skips = skips + 1 if stats["step_skipped"] else 0
        if skips > MAX_SKIPS:
            stop(args, step, f"{skips} consecutive fp16 steps skipped for inf/nan gradients")
    save_hf(model, os.path.join(args.out, "hf"))  # the policy, for experiments/probe.py
    rows = read_metrics(os.path.join(args.out, "metrics.jsonl"))
    last10 = sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:])
    print(f"held-out {rows[0].get('eval_accuracy_before')} -> "
          f"{rows[-1].get('eval_accuracy')} | last-10 reward {last10:.4f}")

# ---------------------------------------------------------------------------------------------
# Flags: argparse refuses what it can (choices, types); check_flags, check_out the rest

def bounded(kind, low, inclusive=True):
    """An argparse type: a finite `kind` number >= low (or > low)."""
    def parse(text):
        value = kind(text)  # a ValueError becomes argparse's "invalid int value"
        if not math.isfinite(value) or not (value >= low if inclusive else value > low):
            relation = ">=" if inclusive else ">"
            raise argparse.ArgumentTypeError(f"must be {relation} {low}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse

def get_args(argv=None):
    count, positive = bounded(int, 1), bounded(float, 0, inclusive=False)
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n")[1:3]),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line: no usage block
    add = p.add_argument
    add("--dtype", default="fp16", choices=DTYPES, help="the trainer's dtype, and the engine's")
    add("--engine-dtype", default=None, choices=DTYPES, help="the engine's; none: --dtype's")
    add("--lm-head", default="same", choices=["same", "fp32"], help="fp32 on both sides")
    add("--trainer-kernels", default="torch", choices=["torch", "engine"],
        help="engine: the trainer runs vLLM's CPU kernels, no mismatch (aligned.py)")
    add("--out", default=None, help="output folder; none: runs/<dtype>")
    add("--seed", type=int, default=0, help="task splits, warm start, and the RL phase")
    add("--rl-seed", type=int, default=None, help="the RL phase alone; none: --seed")
    add("--steps", type=count, default=40)
    add("--batch-size", type=count, default=64, help="prompts per step")
    add("--group-size", type=bounded(int, 2), default=8, help="samples per prompt")
    add("--lr", type=positive, default=3e-4)
    add("--algorithm", default="grpo", choices=ALGORITHMS, help="the loss (grpo_loss)")
    add("--is-cap", type=positive, default=None, help="cap C; none: the algorithm's (CAPS)")
    add("--behavior-logp", default="trainer", choices=["trainer", "engine"],
        help="pi_old: the trainer's score, or the engine's mu (bypass)")
    add("--dr-grpo", action="store_true", help="Dr. GRPO: no std; sums over the budget")
    add("--minibatches", type=count, default=1, help="optimizer steps per rollout batch")
    add("--n-items", type=count, default=12, help="digits to sort: responses of 2n tokens")
    add("--max-new-tokens", type=count, default=None, help="none: 2 x --n-items + 8")
    add("--n-layer", type=count, default=4)
    add("--n-head", type=count, default=4)
    add("--n-embd", type=count, default=128)
    add("--resume", action="store_true", help="continue the run in --out")
    add("--init", default=None, help="a checkpoint folder to start from, not the warm start")
    args = p.parse_args(argv)
    args.engine_dtype = args.engine_dtype or args.dtype
    args.max_new_tokens = args.max_new_tokens or 2 * args.n_items + 8
    args.out = args.out or os.path.join("runs", args.dtype)
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    if args.is_cap is None:
        args.is_cap = CAPS.get(args.algorithm)  # None: no cap
    check_flags(args, p)
    args.state = check_out(args, p)
    return args

def check_flags(args, p):
    """What argparse cannot see, refused before any work."""
    if importlib.util.find_spec("vllm") is None:
        p.error("vLLM is not installed: run `bash setup.sh`")
    try:
        get_precision(args.dtype, args.engine_dtype, args.lm_head,  # bf16 on an old GPU
                      kernels=args.trainer_kernels)
        model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head, args.n_embd)
        load_hf(args.init) if args.init else None
    except ValueError as e:
        p.error(str(e).replace("n_embd/n_head", "--n-embd/--n-head"))
    sequences = args.batch_size * args.group_size
    if args.minibatches > sequences:
        p.error(f"--minibatches {args.minibatches} exceeds the {sequences} sequences of a batch")
    if args.algorithm == "token-tis" and args.behavior_logp == "engine":
        p.error("--algorithm token-tis with --behavior-logp engine: the PPO ratio already is "
                "pi_theta / mu there, a token weight would count it twice (use grpo)")
    if args.dr_grpo and args.algorithm == "gspo":
        p.error("--dr-grpo with --algorithm gspo: GSPO takes each sequence's mean, Dr. GRPO "
                "its sum over the budget; choose one")

def check_out(args, p):
    """Never overwrite a run; --resume needs a readable checkpoint (loaded once, returned).
    args.json is written last, when all else passed."""
    path, state = os.path.join(args.out, "checkpoint.pt"), None
    if args.resume:
        try:
            state = torch.load(path, weights_only=False)
            state["step"]
        except FileNotFoundError:
            p.error(f"--resume: {args.out} has no checkpoint.pt to resume from")
        except Exception as e:  # noqa: BLE001  (a damaged file fails in many ways)
            p.error(f"--resume: {path} is damaged ({type(e).__name__}: {e})".splitlines()[0])
    elif os.path.isfile(os.path.join(args.out, "metrics.jsonl")):
        p.error(f"--out {args.out} holds a run: --resume to continue it, or another --out")
    try:
        os.makedirs(args.out, exist_ok=True)
        record = json.dumps({**vars(args), "machine": machine()}, indent=2)
        write_atomic(os.path.join(args.out, "args.json"), record)
    except OSError as e:
        p.error(f"--out {args.out} cannot be written: {e.strerror}")
    return state

if __name__ == "__main__":
    train(get_args())
