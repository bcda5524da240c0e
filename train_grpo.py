"""
train_grpo.py: RL fine-tuning (GRPO) of a small GPT whose rollouts come from the real vLLM engine,
with one --dtype flag that switches both sides, trainer and engine, between fp16, bf16 and fp32.

    python train_grpo.py --dtype fp16     # or bf16, fp32: same data, same seed, same starting weights

The run: a warm start (supervised, cached: every dtype starts from bit-identical float32 weights),
the vLLM engine started on it, then each step five calls: 1. rollout (the engine samples G responses
per prompt, with its log-probs mu), 2. score (the trainer's log-probs pi of the same tokens),
3. update (the GRPO loss, a backward through the GradScaler, an optimizer step), 4. sync (the new
weights into the running engine, in place), 5. log (a strict-JSON metrics row and a checkpoint).

What it teaches: engine and trainer compute "the same" probabilities with different kernels. In bf16
(7 mantissa bits) they disagree enough to bias the policy gradient; fp16 (10 bits, loss-scaled for
its narrow range) shrinks the disagreement many times; fp32 all but removes it.

Left out on purpose: a value network (GRPO needs none), a KL penalty (the paper's runs use none),
sequence packing, distributed training, an asynchronous engine: none changes where the dtype enters.
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
from model import GPT, GPTConfig, hf_named_tensors, load_hf, save_hf, token_logprobs
from precision import DTYPES, autocast, get_precision, machine, machine_line, mismatch_metrics
from rollout import generate, start_engine, sync_weights

# The paper's algorithms (grpo_loss) and each one's default cap C on its importance weights, from the
# paper's oat sanity scripts: Token-TIS 2, Seq-MIS 10, PG-Seq-IS none, PG-Seq-MIS 3 (oat truncates at C
# where the paper's MIS, and ours, drops the sequence). GSPO's clip range is the GSPO paper's.
ALGORITHMS = ("grpo", "token-tis", "seq-mis", "pg-seq-is", "pg-seq-mis", "gspo")
CAPS = {"token-tis": 2.0, "seq-mis": 10.0, "pg-seq-is": math.inf, "pg-seq-mis": 3.0}
GSPO_CLIP = (3e-4, 4e-4)
CLIP_EPS = 0.2            # PPO's clip range
MAX_GRAD_NORM = 1.0
WARMUP_STEPS, LR_FLOOR = 5, 0.1  # linear learning-rate warm-up, then a cosine decay to LR_FLOOR x --lr
EVAL_EVERY = 10           # steps between held-out evaluations (and after the last step)
N_EVAL = 256              # held-out problems
MAX_SKIPS = 10            # consecutive fp16 steps skipped for inf/nan gradients before the run stops
WARMSTART_DIR = "runs/warmstart"  # cache of warm-start checkpoints, keyed by what determines them
SFT_STEPS, SFT_LR, SFT_BATCH, SFT_NOISE = 600, 3e-3, 64, 0.005  # noise: a solution digit's chance to be wrong
ROLLOUT_STREAM, EVAL_STREAM, AUDIT_STREAM, MINIBATCH_STREAM = 0, 1, 2, 3  # random streams, for stream_seed

def stream_seed(seed, stream, step):  # distinct (seed, stream, step) never collide while step < 999,983
    return seed * 1_000_003 + stream * 999_983 + step

# ---------------------------------------------------------------------------------------------------
# The loss, by hand

def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-6):
    """rewards (N,), N/G groups of G samples of one prompt -> A = (r - group mean) / (group std + eps),
    Dr. GRPO without the division. A group whose samples all agree gets A = 0: no learning signal."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)

def loss_normaliser(mask, algorithm, dr_grpo, max_new_tokens):
    """How a mini-batch's N x T per-token losses add up: loss = sum_it seq_weight_i loss_it / denom.
      default    seq_weight 1,       denom = response tokens    DAPO's token mean: each token counts once
      gspo       seq_weight 1/|y_i|, denom = N                  each sequence's mean, then their mean (GSPO)
      --dr-grpo  seq_weight 1,       denom = N x budget         oat's Dr. GRPO: each sequence's sum over the
                                                                generation budget (--max-new-tokens), not |y_i|"""
    n_seq, ones = torch.tensor(float(mask.shape[0])), torch.ones(mask.shape[0], 1)
    if dr_grpo:
        return ones, n_seq * max_new_tokens
    if algorithm == "gspo":
        return 1 / mask.sum(1, keepdim=True).clamp(min=1), n_seq
    return ones, mask.sum().clamp(min=1)

def resolve_cap(algorithm, cap):  # --is-cap, or the algorithm's own (CAPS); one rule for the loss and its stats
    return CAPS.get(algorithm, math.inf) if cap is None else cap

def grpo_loss(logp, old_logp, mu_logp, adv, mask, seq_weight, denom, algorithm="grpo", cap=None, bypass=False):
    """Returns (loss, ratio, is_weight). Per-token tensors are (N, T), 1 in mask on response tokens.
    logp: the trainer's log-probs, with gradient (pi_theta); old_logp: pi_old, fixed at the rollout
    (the trainer's score, or mu itself with bypass); mu_logp: the engine's, which sampled them (mu).
    The samples come from mu, the objective from pi: the unbiased gradient is E_mu[(pi/mu) A grad log pi].
    Vanilla GRPO drops pi/mu, which differs from 1 by the mismatch alone: the bias the dtype controls.
    With one update per batch and the trainer's pi_old, the PPO ratio is 1 and the clip never binds.
    The paper's algorithms (r_t = pi_theta / pi_old per token, w = pi / mu, C = cap):
      grpo        -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)                       PPO-clip, no correction
      token-tis   grpo, each token times min(w_t, C)                               truncated token IS
      seq-mis     grpo, each sequence times prod_t w_t, or 0 when that exceeds C   masked sequence IS
      pg-seq-is   -w A log pi_theta, w = min(prod_t pi_theta.detach() / mu, C)     plain PG, unbiased if C = inf
      pg-seq-mis  the same with w = 0 when it exceeds C                            dropped, not truncated
      gspo        the PPO-clip form on s = exp(mean_t log(pi_theta / pi_old)), one ratio per sequence,
                  clipped to [1 - 3e-4, 1 + 4e-4]
    token-tis and seq-mis take w's pi from pi_old; with bypass (pi_old = mu) that makes w = 1, so they
    take pi_theta (detached), as verl's bypass mode does."""
    cap, a, ratio, w = resolve_cap(algorithm, cap), adv[:, None], None, None
    pi_logp = logp.detach() if bypass else old_logp  # the pi of the importance weight pi / mu
    if algorithm in ("pg-seq-is", "pg-seq-mis"):
        w = torch.exp(((logp.detach() - mu_logp) * mask).sum(1, keepdim=True))
        w_used = torch.where(w > cap, torch.zeros_like(w), w) if algorithm == "pg-seq-mis" else w.clamp(max=cap)
        per_token = -w_used * a * logp
    else:
        if algorithm == "gspo":  # one ratio per sequence: exp of its mean per-token log-ratio
            lo, hi = GSPO_CLIP
            ratio = torch.exp(((logp - old_logp) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        else:
            lo = hi = CLIP_EPS
            ratio = torch.exp(logp - old_logp)
        per_token = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        if algorithm == "token-tis":
            w = torch.exp((pi_logp - mu_logp) * mask)
            per_token = per_token * w.clamp(max=cap)
        elif algorithm == "seq-mis":
            w = torch.exp(((pi_logp - mu_logp) * mask).sum(1, keepdim=True))
            per_token = per_token * torch.where(w > cap, torch.zeros_like(w), w)
    # float32 throughout: logp comes from token_logprobs' float32 log_softmax, whatever the trainer's
    # dtype, so the loss's sum over ~12,000 tokens carries float32's rounding, not the 16-bit one.
    return (per_token * mask * seq_weight).sum() / denom, ratio, w

def loss_stats(ratio, is_weight, adv, mask, algorithm, cap):
    """What the loss did, counted over the sequences with A != 0 (the only ones with a gradient):
    where the clip binds (the token gets no gradient), by the sign of A; how far pi_theta is from
    pi_old; the importance weights before the cap, per response token (token-tis) or per sequence."""
    a, seqs, stats = adv[:, None], adv != 0, {}
    tokens = mask.bool() & seqs[:, None]
    if ratio is not None:
        ratio = ratio.detach()
        lo, hi = GSPO_CLIP if algorithm == "gspo" else (CLIP_EPS, CLIP_EPS)
        clipped = (((a > 0) & (ratio > 1 + hi)) | ((a < 0) & (ratio < 1 - lo))).expand_as(mask) & tokens
        for sign, side in (("pos", a > 0), ("neg", a < 0)):
            stats[f"clip_frac_{sign}"] = (clipped & side).sum().item() / max(1, (tokens & side).sum().item())
        stats["clip_seq_frac"] = clipped.any(1).sum().item() / max(1, seqs.sum().item())
        stats["ratio_dev_max"] = ((ratio - 1).abs() * mask).max().item()
    if is_weight is not None:
        cap = resolve_cap(algorithm, cap)
        w = is_weight[tokens] if algorithm == "token-tis" else is_weight[seqs]
        if w.numel():
            stats.update(is_weight_mean=w.mean().item(), is_weight_max=w.max().item(),
                         is_capped_frac=(w > cap).float().mean().item())
    return stats

def stop(args, step, why):
    """A non-finite value the run cannot go on from. The checkpoint on disk is the last good state."""
    raise SystemExit(f"error: step {step}: {why}; the checkpoint before it and the metrics are in {args.out}")

def grpo_step(model, opt, scaler, prec, batch, pi_logp, args, step):
    """Step 3: the rollout batch in --minibatches mini-batches (shuffled, as oat and verl do), one
    optimizer step each, pi_old fixed at the rollout; with one mini-batch there is nothing to shuffle.
    Returns the update's stats, averaged over the mini-batches."""
    generator = torch.Generator().manual_seed(stream_seed(args.rl_seed, MINIBATCH_STREAM, step))
    order = torch.randperm(len(batch.adv), generator=generator) if args.minibatches > 1 else torch.arange(len(batch.adv))
    old_logp, stats = batch.mu_logp if args.behavior_logp == "engine" else pi_logp, []
    for rows in order.chunk(args.minibatches):
        seq_weight, denom = loss_normaliser(batch.mask[rows], args.algorithm, args.dr_grpo, args.max_new_tokens)
        # A sequence with A = 0 (its group all agree) adds exactly 0 to the loss and the gradient: leave
        # it out of the forward and backward, but in the normaliser. Half the work near 90 % reward.
        keep = (batch.adv[rows] != 0) | ~(batch.adv[rows] != 0).any()  # all of them if none has an advantage
        kept = rows[keep]
        logp = token_logprobs(prec.forward(model), batch.idx[kept])
        loss, ratio, is_weight = grpo_loss(logp, old_logp[kept], batch.mu_logp[kept], batch.adv[kept],
                                           batch.mask[kept], seq_weight[keep], denom, algorithm=args.algorithm,
                                           cap=args.is_cap, bypass=args.behavior_logp == "engine")
        if not torch.isfinite(loss):
            stop(args, step, f"non-finite loss ({loss.item()})")
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # fp16: loss x scale, so small gradients survive fp16's range
        grad_norm, skipped = unscale_clip_step(model, opt, scaler)
        if skipped and not scaler.is_enabled():
            stop(args, step, "non-finite gradient (the step was skipped; only fp16 expects that)")
        stats.append({"loss": loss.item(), **loss_stats(ratio, is_weight, batch.adv[kept], batch.mask[kept],
                                                        args.algorithm, args.is_cap),
                      "grad_norm": grad_norm, "step_skipped": skipped})
    keys = dict.fromkeys(k for s in stats for k in s)  # a mini-batch with no IS weight to show lacks those keys
    mean = {k: sum(s[k] for s in stats if k in s) / sum(k in s for s in stats) for k in keys}
    return {**mean, "step_skipped": any(s["step_skipped"] for s in stats), "loss_scale": scaler.get_scale()}

def unscale_clip_step(model, opt, scaler):
    """Returns (grad norm, skipped). fp16: unscale_ divides the float32 gradients by the scale before
    the clip, so it sees true norms; step() skips the update if any gradient is inf/nan, and update()
    halves the scale (or doubles it after enough clean steps). bf16/fp32: the scaler passes straight
    through; a non-finite gradient there is never expected: we skip the step too, and report it."""
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item()
    scale_before = scaler.get_scale()
    if scaler.is_enabled() or math.isfinite(grad_norm):
        scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale_before if scaler.is_enabled() else not math.isfinite(grad_norm)
    return grad_norm, skipped

def learning_rate(args, step):
    """Linear warm-up (Adam's first updates move every weight by ~lr whatever the gradient, enough to
    knock a tuned model over), then a cosine decay to a tenth, so the noisy late steps settle."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    progress = max(0.0, step - WARMUP_STEPS) / max(1, args.steps - WARMUP_STEPS)
    return args.lr * warm * (LR_FLOOR + (1 - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress)))

# ---------------------------------------------------------------------------------------------------
# Batches, the warm start, the model's shape

def pack(prompts, responses, device, logprobs=None):
    """Right-padded (N, T) token ids, a (N, T-1) mask of the predicted response tokens (token_logprobs'
    shape), and the engine's log-probs laid out the same way (zeros if none)."""
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

def model_config(n_items, max_new_tokens, n_layer=4, n_head=4, n_embd=128):
    """The GPT for this task (context: a power of two >= the longest prompt + response, and >= 128).
    Raises ValueError for a head size vLLM cannot serve."""
    prompt = task.prompt_ids(task.make_problem(random.Random(0), n_items)[0])
    max_seq_len = max(128, 2 ** math.ceil(math.log2(len(prompt) + max_new_tokens)))
    return GPTConfig(vocab_size=task.VOCAB_SIZE, n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_hidden=3 * n_embd,
                     max_seq_len=max_seq_len, bos_id=task.BOS_ID, eos_id=task.EOS_ID)

def warm_start(cfg, n_items, seed, device):
    """Returns the checkpoint folder of the warm-started model, training it only if no cached copy
    exists for exactly these settings (the key hashes everything that determines the weights)."""
    key = json.dumps({"cfg": cfg.__dict__, "n_items": n_items, "seed": seed, "steps": SFT_STEPS, "lr": SFT_LR,
                      "batch": SFT_BATCH, "noise": SFT_NOISE}, sort_keys=True)
    ckpt = os.path.join(WARMSTART_DIR, hashlib.sha256(key.encode()).hexdigest()[:12])
    if os.path.isfile(os.path.join(ckpt, "config.json")):  # save_hf writes it last: present = complete
        print(f"warm start: reusing {ckpt}")
        return ckpt
    _, train_batch = task.make_splits(seed, n_items, N_EVAL)
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(SFT_STEPS):
        lr = SFT_LR * min(1.0, (step + 1) / 50) * (0.5 + 0.5 * math.cos(math.pi * step / SFT_STEPS))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = train_batch(f"{seed}-sft-{step}", SFT_BATCH)
        noise_rng = random.Random(f"noise-{seed}-{step}")
        answers = [task.answer_ids(task.noisy_answer(a, noise_rng, SFT_NOISE)) for _, a in batch]
        idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch], answers, device)
        with autocast("bf16", device):  # as base models are trained: float32 weights, bf16 matmuls, no scaling
            loss = -(token_logprobs(model, idx) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == SFT_STEPS - 1:
            print(f"warm start {step:4d}/{SFT_STEPS} | loss {loss.item():.4f}", flush=True)
    save_hf(model, ckpt)
    return ckpt

# ---------------------------------------------------------------------------------------------------
# The loop's steps 1, 2 and 5, and the evaluation

@dataclass
class Batch:
    idx: torch.Tensor      # (N, T) prompt + response token ids, right-padded
    mask: torch.Tensor     # (N, T-1) 1 where a response token is predicted
    mu_logp: torch.Tensor  # (N, T-1) the engine's log-prob of each sampled token
    adv: torch.Tensor      # (N,) the group advantages
    log: dict              # the rollout's figures for the metrics row

def rollout(llm, train_batch, args, step, device):
    """Step 1: the engine samples G responses per prompt with its log-probs (mu); rewards, advantages."""
    t0 = time.perf_counter()
    problems = train_batch(f"{args.rl_seed}-{step}", args.batch_size)
    # The in-process engine samples from torch's global generator (a per-request seed crashes its CPU
    # sampler once requests are batched): seeding it makes sampling a function of (weights, seed, step).
    torch.manual_seed(stream_seed(args.rl_seed, ROLLOUT_STREAM, step))
    samples = generate(llm, [task.prompt_ids(p) for p, _ in problems], args.group_size, args.max_new_tokens, task.EOS_ID)
    answers = [a for _, a in problems for _ in range(args.group_size)]
    rewards = torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)])
    idx, mask, mu_logp = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device,
                              [s.logprobs for s in samples])
    adv = group_advantages(rewards, args.group_size, scale_by_std=not args.dr_grpo).to(device)
    seconds, n_tokens = time.perf_counter() - t0, int(mask.sum())
    return Batch(idx, mask, mu_logp, adv, {"reward_mean": rewards.mean().item(), "response_len_mean": n_tokens / len(samples),
                                           "truncated_frac": sum(not s.finished for s in samples) / len(samples),
                                           "time_rollout_s": seconds, "rollout_tokens_per_s": n_tokens / seconds})

def score(model, prec, batch):
    """Step 2: pi, the trainer's log-probs of the sampled tokens before the update (pi_old, unless
    --behavior-logp engine takes mu), in its dtype."""
    with torch.no_grad():
        return token_logprobs(prec.forward(model), batch.idx)

def evaluate(llm, eval_problems, args, step):
    """Sampled accuracy at temperature 1 on the held-out problems, one sample each, with the engine."""
    torch.manual_seed(stream_seed(args.rl_seed, EVAL_STREAM, step))
    samples = generate(llm, [task.prompt_ids(p) for p, _ in eval_problems], 1, args.max_new_tokens, task.EOS_ID)
    return sum(task.reward(s.response_ids, a) for s, (_, a) in zip(samples, eval_problems)) / len(eval_problems)

def log_step(out, step, rec, model, opt, scaler):
    """Step 5: append the row as strict JSON (other readers reject NaN: a non-finite value is written
    as null and its key listed under "nonfinite"), print it, and checkpoint: all a resumed run needs,
    since the data and sampling of step s depend on (seed, s) alone."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    row = {**{k: None if k in bad else v for k, v in rec.items()}, **({"nonfinite": bad} if bad else {})}
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")
    state = {"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    torch.save(state, os.path.join(out, "checkpoint.pt.tmp"))
    os.replace(os.path.join(out, "checkpoint.pt.tmp"), os.path.join(out, "checkpoint.pt"))  # as write_atomic
    print(f"step {step:4d} | reward {rec['reward_mean']:.3f} | k3 {rec['mismatch_k3']:.2e} | gnorm {rec['grad_norm']:.3f} "
          f"| scale {rec['loss_scale']:.0f}{' SKIP' * rec['step_skipped']} | {rec['time_step_s']:.2f}s | eval "
          f"{rec.get('eval_accuracy', '-')}", flush=True)

# ---------------------------------------------------------------------------------------------------
# Files: written atomically; a checkpoint every step (12 MB, ~10 ms), so a kill loses one step at most

def resume(out, model, opt, scaler):
    """Load the checkpoint, cut metrics.jsonl back to its step (a line cut by a kill goes too): no step twice."""
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    for obj, key in ((model, "model"), (opt, "opt"), (scaler, "scaler")):
        obj.load_state_dict(state[key])
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))[:state["step"]]
    write_atomic(os.path.join(out, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    print(f"resuming {out} at step {state['step']}")
    return state["step"]

def write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # a kill leaves the old file or the new one, never half of one

def read_metrics(path):
    rows = []
    for line in open(path) if os.path.isfile(path) else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a hard kill: that step is redone
            break
    return rows

# ---------------------------------------------------------------------------------------------------
# The run

def train(args, llm=None):
    """The whole run. `llm`: a running engine of the engine's dtype to reuse (the tests share one)."""
    prec = get_precision(args.dtype, args.engine_dtype, args.lm_head)
    eval_problems, train_batch = task.make_splits(args.seed, args.n_items, N_EVAL)
    cfg = model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head, args.n_embd)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, prec.device)
    model = load_hf(ckpt, prec.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    scaler = prec.grad_scaler()
    start = resume(args.out, model, opt, scaler) if args.resume else 0
    llm = llm or start_engine(ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32)
    sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)  # the weights the trainer starts from
    acc0, skips = (evaluate(llm, eval_problems, args, -1) if start == 0 else None), 0
    print(f"trainer {args.dtype} | engine {prec.vllm_dtype} | LM head {'fp32' if prec.head_fp32 else args.dtype} "
          f"| {machine_line(machine())} | held-out accuracy before RL {acc0}")

    for step in range(start, args.steps):
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = learning_rate(args, step)
        batch = rollout(llm, train_batch, args, step, prec.device)                # 1. sample (mu)
        t1 = time.perf_counter()
        pi_logp = score(model, prec, batch)                                       # 2. pi
        t2 = time.perf_counter()
        if not torch.isfinite(torch.stack([batch.mu_logp, pi_logp])[:, batch.mask.bool()]).all():
            stop(args, step, "non-finite log-prob (engine or trainer)")
        stats = grpo_step(model, opt, scaler, prec, batch, pi_logp, args, step)  # 3. update
        t3 = time.perf_counter()
        seconds_sync = sync_weights(llm, hf_named_tensors(model), prec.engine_dtype)  # 4. sync
        rec = {"step": step, "lr": opt.param_groups[0]["lr"], **batch.log, **mismatch_metrics(batch.mu_logp, pi_logp, batch.mask),
               **stats, "time_logprob_s": t2 - t1, "time_train_s": t3 - t2, "time_sync_s": seconds_sync}
        if step == 0:
            rec["eval_accuracy_before"] = acc0
        if (step + 1) % EVAL_EVERY == 0 or step == args.steps - 1:
            rec["eval_accuracy"] = evaluate(llm, eval_problems, args, step)
        rec["time_step_s"] = time.perf_counter() - t0
        log_step(args.out, step, rec, model, opt, scaler)                         # 5. log, checkpoint
        skips = skips + 1 if stats["step_skipped"] else 0
        if skips > MAX_SKIPS:
            stop(args, step, f"{skips} consecutive fp16 steps skipped for inf/nan gradients")
    save_hf(model, os.path.join(args.out, "hf"))  # the trained policy, for experiments/probe.py --init
    rows = read_metrics(os.path.join(args.out, "metrics.jsonl"))
    print(f"held-out {rows[0].get('eval_accuracy_before')} -> {rows[-1].get('eval_accuracy')} | "
          f"last-10 reward {sum(r['reward_mean'] for r in rows[-10:]) / len(rows[-10:]):.4f}")

# ---------------------------------------------------------------------------------------------------
# Flags: argparse refuses what it can (choices, types); check() the rest, before any work

def bounded(kind, low, inclusive=True):
    """An argparse type: a finite `kind` number >= low (or > low)."""
    def parse(text):
        value = kind(text)  # a ValueError becomes argparse's "invalid int value"
        if not math.isfinite(value) or not (value >= low if inclusive else value > low):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse

def get_args(argv=None):
    positive_int, positive = bounded(int, 1), bounded(float, 0, inclusive=False)
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n")[1:3]), formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line: argparse's own adds a usage block
    p.add_argument("--dtype", default="fp16", choices=DTYPES, help="the trainer's dtype, and the engine's")
    p.add_argument("--engine-dtype", default=None, choices=DTYPES, help="the engine's dtype; none: --dtype's")
    p.add_argument("--lm-head", default="same", choices=["same", "fp32"], help="fp32: the LM head in float32 on both sides")
    p.add_argument("--out", default=None, help="output folder; none: runs/<dtype>")
    p.add_argument("--seed", type=int, default=0, help="task splits, warm start, and the RL phase")
    p.add_argument("--rl-seed", type=int, default=None, help="the RL phase's prompts and sampling alone; none: --seed")
    p.add_argument("--steps", type=positive_int, default=40)
    p.add_argument("--batch-size", type=positive_int, default=64, help="prompts per step")
    p.add_argument("--group-size", type=bounded(int, 2), default=8, help="samples per prompt (GRPO compares within a group)")
    p.add_argument("--lr", type=positive, default=3e-4)
    p.add_argument("--algorithm", default="grpo", choices=ALGORITHMS, help="the loss (grpo_loss's docstring)")
    p.add_argument("--is-cap", type=positive, default=None, help="cap C of the importance weights; none: the algorithm's own (CAPS)")
    p.add_argument("--behavior-logp", default="trainer", choices=["trainer", "engine"],
                   help="pi_old: the trainer's score of the samples, or the engine's own log-probs (mu)")
    p.add_argument("--dr-grpo", action="store_true", help="Dr. GRPO: no std division; each sequence's sum over --max-new-tokens")
    p.add_argument("--minibatches", type=positive_int, default=1, help="optimizer steps per rollout batch, one per mini-batch")
    p.add_argument("--n-items", type=positive_int, default=12, help="digits to sort: the response is 2*n tokens")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="generation budget; none: 2*n-items + 8")
    p.add_argument("--n-layer", type=positive_int, default=4)
    p.add_argument("--n-head", type=positive_int, default=4)
    p.add_argument("--n-embd", type=positive_int, default=128)
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--init", default=None, help="start RL from this checkpoint folder instead of the warm start")
    args = p.parse_args(argv)
    args.engine_dtype = args.engine_dtype or args.dtype
    args.max_new_tokens = args.max_new_tokens or 2 * args.n_items + 8
    args.out = args.out or os.path.join("runs", args.dtype)
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    check(args, p)
    return args

def check(args, p):
    """What argparse cannot see, refused before the warm start, so nothing already written is lost."""
    if importlib.util.find_spec("vllm") is None:
        p.error("vLLM is not installed: run `bash setup.sh`")
    try:
        get_precision(args.dtype, args.engine_dtype, args.lm_head)  # e.g. bf16 on a GPU without it
        model_config(args.n_items, args.max_new_tokens, args.n_layer, args.n_head, args.n_embd)
        load_hf(args.init) if args.init else None
    except ValueError as e:
        p.error(str(e).replace("n_embd/n_head", "--n-embd/--n-head"))
    if args.minibatches > args.batch_size * args.group_size:
        p.error(f"--minibatches {args.minibatches} exceeds the {args.batch_size * args.group_size} sequences of a batch")
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    if args.resume:
        try:
            torch.load(checkpoint, weights_only=False)["step"]
        except FileNotFoundError:
            p.error(f"--resume: {args.out} has no checkpoint.pt to resume from")
        except Exception as e:  # noqa: BLE001  (a damaged file fails in many ways: unpickling, zip, key)
            p.error(f"--resume: {checkpoint} is damaged ({type(e).__name__}: {e})".splitlines()[0])
    elif os.path.isfile(os.path.join(args.out, "metrics.jsonl")):
        p.error(f"--out {args.out} already holds a run: pass --resume to continue it, or choose another --out")
    try:
        os.makedirs(args.out, exist_ok=True)
        write_atomic(os.path.join(args.out, "args.json"), json.dumps({**vars(args), "machine": machine()}, indent=2))
    except OSError as e:
        p.error(f"--out {args.out} cannot be written: {e.strerror}")

if __name__ == "__main__":
    train(get_args())
