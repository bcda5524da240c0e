"""
train_grpo.py: RL fine-tuning (GRPO) of a small GPT whose rollouts come from the real vLLM engine,
with one --dtype flag that switches both sides, trainer and engine, between fp16, bf16 and fp32.

    python train_grpo.py --dtype fp16     # or bf16, fp32: same data, same seed, same starting weights

The run, top to bottom:
  1. warm start: supervised training on worked solutions, cached, so every dtype starts from
     bit-identical float32 weights;
  2. start the vLLM engine on those weights in the run's dtype;
  3. each step: rollout (the engine samples G responses per prompt, with its log-probs mu), score
     (the trainer's log-probs pi of the same tokens, and how far mu is from pi), one GRPO step through
     the GradScaler, sync (the new weights go into the engine in place), log.

What it teaches: the engine and the trainer compute "the same" probabilities with different kernels.
In bf16 (7 mantissa bits) they disagree enough to bias the policy gradient; in fp16 (10 bits, with
loss scaling for its narrow range) the disagreement shrinks many times; in fp32 it all but vanishes.

Left out on purpose: a value network (GRPO needs none), a reference-model KL by default (--kl-coef
adds one), sequence packing, gradient accumulation, distributed training and an asynchronous engine:
none changes where the dtype enters, and each would hide it under more code. The run's hardening
(lock, signals, resume, atomic files, input checks) lives in harness.py, out of the reader's way.
"""
import argparse
import hashlib
import json
import math
import os
import random
import time

import torch

import task
from harness import Run, check_args, fail, number, run_folder
from model import GPT, GPTConfig, hf_named_tensors, load_hf, save_hf, token_logprobs
from precision import ALIASES, get_precision, machine, machine_line, mismatch_metrics
from rollout import generate, require_vllm, start_engine, sync_weights  # vllm itself is imported lazily

# The paper's algorithms (grpo_loss) and the cap C each one's importance weights use by default:
# Token-TIS 2 and GRPO + Seq-MIS 10 from the paper's oat sanity scripts (--tis_c 2, --seq_is_clip_max
# 10); PG-Seq-IS unbounded (oat's default); PG-Seq-MIS 3 (oat's bf16_seq_mis.sh, whose code truncates
# at C where the paper's MIS, and ours, drops the sequence). GSPO clips its
# length-normalised sequence ratio to [1 - 3e-4, 1 + 4e-4] (the GSPO paper's range, as oat uses it).
ALGORITHMS = ("grpo", "token-tis", "seq-mis", "pg-seq-is", "pg-seq-mis", "gspo")
CAPS = {"token-tis": 2.0, "seq-mis": 10.0, "pg-seq-is": math.inf, "pg-seq-mis": 3.0}
GSPO_CLIP = (3e-4, 4e-4)


# ---------------------------------------------------------------------------------------------------
# Flags

POS_INT, POS_FLOAT, NONNEG = number(int), number(float), number(float, low_ok=True)


def make_parser(description):
    """The flags of a run; probe.py adds its own to the same parser (same task, model, warm start)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dtype", default="fp16", choices=sorted(ALIASES), metavar="{fp16,bf16,fp32}",
                   help="the trainer's and the engine's dtype")
    p.add_argument("--out", default=None, help="output folder (default runs/<dtype>)")
    p.add_argument("--warmstart-dir", default="runs/warmstart", help="cache of warm-start checkpoints")
    p.add_argument("--seed", type=int, default=0, help="task splits, warm start, and the RL phase")
    p.add_argument("--rl-seed", type=int, default=None, help="the RL phase's prompts and sampling alone "
                   "(default: --seed): seeds of one warm start")
    # the task
    p.add_argument("--n-items", type=POS_INT, default=12, help="digits to sort: the response is 2*n tokens")
    p.add_argument("--n-eval", type=POS_INT, default=256, help="held-out problems")
    p.add_argument("--max-new-tokens", type=POS_INT, default=None, help="default: 2*n-items + 8")
    # the model
    p.add_argument("--n-layer", type=POS_INT, default=4)
    p.add_argument("--n-head", type=POS_INT, default=4)
    p.add_argument("--n-embd", type=POS_INT, default=128)
    p.add_argument("--n-hidden", type=POS_INT, default=384)
    p.add_argument("--max-seq-len", type=POS_INT, default=128)
    # warm start
    p.add_argument("--sft-steps", type=POS_INT, default=600)
    p.add_argument("--sft-lr", type=POS_FLOAT, default=3e-3)
    p.add_argument("--sft-batch", type=POS_INT, default=64)
    p.add_argument("--sft-noise", type=number(float, low_ok=True, high=0.999), default=0.005,
                   help="chance each digit of a training solution is wrong")
    # GRPO
    p.add_argument("--steps", type=POS_INT, default=40)
    p.add_argument("--batch-size", type=POS_INT, default=64, help="prompts per step")
    p.add_argument("--group-size", type=number(int, low=2, low_ok=True), default=8,
                   help="samples per prompt (GRPO compares samples within a group, so >= 2)")
    p.add_argument("--lr", type=POS_FLOAT, default=3e-4)
    p.add_argument("--warmup-steps", type=POS_INT, default=5, help="linear learning-rate warm-up")
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"], help="after the warm-up")
    p.add_argument("--algorithm", default="grpo", choices=ALGORITHMS, help="the loss (grpo_loss's docstring)")
    p.add_argument("--is-cap", type=POS_FLOAT, default=None, help="cap C of the importance weights "
                   "(default: the algorithm's own, CAPS)")
    p.add_argument("--behavior-logp", default="trainer", choices=["trainer", "engine"],
                   help="pi_old: the trainer re-scores the samples, or the engine's own log-probs (mu)")
    p.add_argument("--clip-eps", type=POS_FLOAT, default=0.2, help="PPO clip range (GSPO has its own)")
    p.add_argument("--max-grad-norm", type=POS_FLOAT, default=1.0)
    p.add_argument("--updates-per-batch", type=POS_INT, default=1, help="optimizer steps per rollout batch")
    p.add_argument("--no-std", action="store_true", help="Dr. GRPO: do not divide advantages by the group std")
    p.add_argument("--kl-coef", type=NONNEG, default=0.0, help="k3 KL to the warm start (0 = off)")
    p.add_argument("--eval-every", type=POS_INT, default=10)
    p.add_argument("--ckpt-every", type=POS_INT, default=10, help="steps between resumable checkpoints")
    p.add_argument("--max-skips", type=number(int, low_ok=True), default=10,
                   help="stop after more consecutive fp16 steps skipped")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--init", default=None, help="start RL from this checkpoint folder instead of the warm start")
    p.add_argument("--gpu-memory-utilization", type=number(float, high=1.0), default=0.3,
                   help="engine's share of GPU memory (GPU only)")
    p.error = lambda message: fail(message)  # one line, exit 2 (argparse would add a usage block)
    return p


# ---------------------------------------------------------------------------------------------------
# The loss, by hand

def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-6):
    """rewards (N,) laid out as N/G groups of G samples of one prompt -> advantages (N,).
    A = (r - mean of its group) / (std of its group + eps); Dr. GRPO drops the division. A group whose
    samples all got the same reward gets A = 0 everywhere: it carries no learning signal."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logp, old_logp, mu_logp, adv, mask, algorithm="grpo", clip_eps=0.2, cap=None,
              ref_logp=None, kl_coef=0.0, n_tokens=None):
    """Returns (loss, stats). Per-token tensors are (N, T), aligned with the predicted token; mask is 1
    on response tokens. logp: the trainer's log-probs with gradient (pi_theta); old_logp: pi_old, no
    gradient (the trainer's re-scoring before the update, or mu itself with --behavior-logp engine);
    mu_logp: the engine's log-probs of the same tokens (mu, the policy that actually sampled).

    The samples come from mu, but the objective is defined by pi: the unbiased policy gradient is
    E_mu[(pi/mu) A grad log pi]. Vanilla GRPO drops pi/mu, which differs from 1 by the training-inference
    mismatch alone: that is the bias the dtype controls. With one update per batch and pi_old from the
    trainer, pi_old = pi_theta at the step, so the PPO ratio is 1 and clipping is inactive. The paper's
    algorithms (r_t = pi_theta / pi_old per token, rho = prod_t pi_old / mu per sequence, C = cap):
      grpo        -min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)                       PPO-clip, no correction
      token-tis   grpo, each token times min(pi_old / mu, C)                       truncated token IS
      seq-mis     grpo, each sequence times rho, or 0 when rho > C                 masked sequence IS
      pg-seq-is   -w A log pi_theta, w = min(prod_t pi_theta.detach() / mu, C)     plain PG, unbiased if C = inf
      pg-seq-mis  the same with w = 0 when it exceeds C                            dropped, not truncated
      gspo        the PPO-clip form on s = exp(mean_t log(pi_theta / pi_old)), one ratio per sequence,
                  clipped to [1 - 3e-4, 1 + 4e-4]
    Normalisation: the sum over every response token of the batch divided by their count (DAPO's token
    mean); n_tokens, when given, is that count for a batch of which only some sequences were passed in.
    Optional k3 KL penalty to a reference policy (ref_logp)."""
    cap = CAPS.get(algorithm, math.inf) if cap is None else cap
    a, stats = adv[:, None], {}
    log_rho = ((old_logp - mu_logp).detach() * mask).sum(1, keepdim=True)  # log of prod_t pi_old / mu

    def capped(w, mask_instead):  # truncate (or drop) importance weights above the cap, with their stats
        over = w > cap
        stats.update(is_weight_mean=w.mean().item(), is_weight_max=w.max().item(),
                     is_capped_frac=over.float().mean().item())
        return torch.where(over, torch.zeros_like(w), w) if mask_instead else w.clamp(max=cap)

    if algorithm in ("pg-seq-is", "pg-seq-mis"):
        w = torch.exp(((logp.detach() - mu_logp) * mask).sum(1, keepdim=True))
        per_token = -capped(w, algorithm == "pg-seq-mis") * a * logp
    else:
        if algorithm == "gspo":
            lo, hi = GSPO_CLIP
            ratio = torch.exp(((logp - old_logp) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        else:
            lo = hi = clip_eps
            ratio = torch.exp(logp - old_logp)
        per_token = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
        # Where the clip binds (so the token or sequence gets no gradient), by the sign of the advantage.
        clipped = (((a > 0) & (ratio > 1 + hi)) | ((a < 0) & (ratio < 1 - lo))).expand_as(mask) * mask.bool()
        for sign, side in (("pos", a > 0), ("neg", a < 0)):
            tokens = mask.bool() & side
            stats[f"clip_frac_{sign}"] = (clipped & tokens).sum().item() / max(1, tokens.sum().item())
        stats["clip_seq_frac"] = clipped.any(1).float().mean().item()
        stats["ratio_dev_max"] = ((ratio.detach() - 1).abs() * mask).max().item()  # how far pi_theta is from pi_old
        if algorithm == "token-tis":
            per_token = per_token * capped(torch.exp((old_logp - mu_logp).detach() * mask), False)
        elif algorithm == "seq-mis":
            per_token = per_token * capped(torch.exp(log_rho), True)
    if kl_coef:
        log_r = ref_logp.detach() - logp  # k3 estimator of KL(pi || ref): r - 1 - log r, r = ref / pi
        per_token = per_token + kl_coef * (torch.exp(log_r) - 1 - log_r)
    return (per_token * mask).sum() / (mask.sum() if n_tokens is None else n_tokens).clamp(min=1), stats


def grpo_step(model, opt, scaler, prec, batch, args):
    """The loop's step 3: loss, scaled backward, unscale, clip, optimizer step (--updates-per-batch
    times). Returns the first update's stats, with pi (the trainer's log-probs before the update) when
    the batch came without one (--behavior-logp engine skips the separate re-scoring forward)."""
    # A sequence with A = 0 (every group whose samples all agree) adds exactly 0 to the loss and its
    # gradient: leave it out of the forward and backward, but keep all response tokens in the
    # token-mean's denominator. Same gradient, less work (half of it near 90 % reward). Kept in when
    # the first forward must also give pi for every token, and for the KL term, which counts them all.
    keep = batch["adv"] != 0
    if args.kl_coef or "pi_logp" not in batch or not keep.any():
        keep = torch.ones_like(keep)
    old_logp = batch["mu_logp"] if args.behavior_logp == "engine" else batch["pi_logp"]
    first = None
    for _ in range(args.updates_per_batch):
        logp = token_logprobs(prec.forward(model), batch["idx"][keep])
        loss, stats = grpo_loss(logp, old_logp[keep], batch["mu_logp"][keep], batch["adv"][keep], batch["mask"][keep],
                                algorithm=args.algorithm, clip_eps=args.clip_eps, cap=args.is_cap,
                                ref_logp=batch["ref_logp"][keep] if args.kl_coef else None,
                                kl_coef=args.kl_coef, n_tokens=batch["mask"].sum())
        if not torch.isfinite(loss):
            return {"nonfinite": f"non-finite loss ({loss.item()})"}
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # fp16: loss x scale, so small gradients survive fp16's range
        grad_norm, skipped = unscale_clip_step(model, opt, scaler, args.max_grad_norm)
        if first is None:
            first = {"loss": loss.item(), **stats, "grad_norm": grad_norm, "step_skipped": skipped,
                     "loss_scale": scaler.get_scale(), **({} if "pi_logp" in batch else {"pi_logp": logp.detach()})}
    return first


def unscale_clip_step(model, opt, scaler, max_grad_norm):
    """Returns (grad norm, skipped). fp16: unscale_ divides the float32 master gradients by the scale
    before clipping, so the clip sees true norms; scaler.step skips the optimizer step if any gradient
    is inf/nan, and update() then halves the scale (or doubles it after enough clean steps).
    bf16/fp32: the scaler is disabled and these lines pass straight through; a non-finite gradient
    there is never 'expected', so we skip the step (weights untouched) and report it."""
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm).item()
    scale_before = scaler.get_scale()
    if scaler.is_enabled() or math.isfinite(grad_norm):
        scaler.step(opt)
    scaler.update()
    skipped = scaler.get_scale() < scale_before if scaler.is_enabled() else not math.isfinite(grad_norm)
    return grad_norm, skipped


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
    """The prompts of one step depend on (seed, step) alone: repeatable runs, exact resume. RL steps
    draw from the --rl-seed stream, so RL seeds vary the prompts without changing the warm start."""
    gen = args.train_problems(f"{args.seed if str(step).startswith('sft') else args.rl_seed}-{step}")
    return [next(gen) for _ in range(n)]


def seed_engine_sampling(seed, step, stream=0):
    """The in-process vLLM engine samples from torch's global generator (a per-request seed crashes its
    CPU sampler once requests are batched), so we seed that generator before every generate: sampling
    is then a function of (weights, seed, step), which makes runs repeatable and resume exact. Stream 0
    is the training rollouts, 1 the held-out evaluation: distinct (seed, stream, step) never collide
    while step < 999,983."""
    torch.manual_seed(seed * 1_000_003 + stream * 999_983 + step)


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


def model_config(args):
    return GPTConfig(vocab_size=task.VOCAB_SIZE, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                     n_hidden=args.n_hidden, max_seq_len=args.max_seq_len, bos_id=task.BOS_ID, eos_id=task.EOS_ID)


# ---------------------------------------------------------------------------------------------------
# The loop's steps 1, 2 and 5, and the evaluation

def rollout(llm, args, step, device):
    """Step 1: the engine samples G responses per prompt, with its own log-probs (mu); the rewards
    and the group advantages."""
    t0 = time.perf_counter()
    probs = problems_for_step(args, step, args.batch_size)
    seed_engine_sampling(args.rl_seed, step)
    samples = generate(llm, [task.prompt_ids(p) for p, _ in probs], args.group_size, args.max_new_tokens, task.EOS_ID)
    rewards = torch.tensor([task.reward(s.response_ids, a) for s, (_, a) in
                            zip(samples, (pa for pa in probs for _ in range(args.group_size)))])
    idx, mask, mu_logp = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device,
                              [s.logprobs for s in samples])
    n_tokens = int(mask.sum())
    return {"idx": idx, "mask": mask, "mu_logp": mu_logp, "rewards": rewards,
            "adv": group_advantages(rewards, args.group_size, scale_by_std=not args.no_std).to(device),
            "log": {"reward_mean": rewards.mean().item(), "response_len_mean": n_tokens / len(samples),
                    "truncated_frac": sum(not s.finished for s in samples) / len(samples),
                    "time_rollout_s": time.perf_counter() - t0,
                    "rollout_tokens_per_s": n_tokens / (time.perf_counter() - t0)}}


def score(model, ref_model, prec, batch, args):
    """Step 2: the trainer's log-probs of the sampled tokens in the run's dtype, before the update
    (pi_old), and the reference model's for the KL term. With --behavior-logp engine there is no
    re-scoring forward: mu serves as pi_old, and the first update's forward gives pi for the metrics."""
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.behavior_logp == "trainer":
            batch["pi_logp"] = token_logprobs(prec.forward(model), batch["idx"])
        if ref_model is not None:
            batch["ref_logp"] = token_logprobs(prec.forward(ref_model), batch["idx"])
    batch["log"]["time_logprob_s"] = time.perf_counter() - t0


def evaluate(llm, args, step):
    """Sampled accuracy at temperature 1 on the held-out problems, one sample each, with the engine."""
    seed_engine_sampling(args.rl_seed, step, stream=1)
    probs = args.eval_problems
    samples = generate(llm, [task.prompt_ids(p) for p, _ in probs], 1, args.max_new_tokens, task.EOS_ID)
    return sum(task.reward(s.response_ids, a) for s, (_, a) in zip(samples, probs)) / len(probs)


def log_step(step, batch, stats, t_sync, t0):
    """Step 5's row: rollout and score figures, the mismatch of mu against pi, the update's stats."""
    mask, mu, pi = batch["mask"], batch["mu_logp"], batch.get("pi_logp", stats.pop("pi_logp", None))
    rec = {"step": step, **batch["log"], **mismatch_metrics(mu, pi, mask), **stats, "time_sync_s": t_sync}
    rec["time_train_s"] = time.perf_counter() - t0 - rec["time_rollout_s"] - rec.get("time_logprob_s", 0.0) - t_sync
    return rec


# ---------------------------------------------------------------------------------------------------
# The run

def train(args, llm=None):
    """The whole run. `llm`: an already running engine of the run's dtype to reuse (the tests share one
    per session); the starting weights are synced into it, which is the same as starting it on them."""
    require_vllm()
    prec = get_precision(args.dtype)
    with run_folder(args.out) as stop:  # a lock on --out; Ctrl-C / SIGTERM only set `stop`
        ckpt = args.init or warm_start(args, model_config(args), prec.device)[0]
        model = load_hf(ckpt, prec.device)
        ref_model = load_hf(ckpt, prec.device).eval() if args.kl_coef else None
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
        scaler = prec.grad_scaler()
        run = Run(args, prec, model, opt, scaler)
        llm = llm or start_engine(ckpt, prec.vllm_dtype, args.seed, args.max_seq_len, args.gpu_memory_utilization)
        sync_weights(llm, hf_named_tensors(model), prec.dtype)  # the weights the trainer starts from
        if run.acc0 is None:
            run.acc0 = evaluate(llm, args, -1)
        print(f"dtype {prec.name} | engine {prec.vllm_dtype} | {machine_line(machine())} | "
              f"held-out accuracy before RL {run.acc0:.3f}")

        for step in range(run.start_step, args.steps):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = learning_rate(args, step)
            batch = rollout(llm, args, step, prec.device)                       # 1. sample (mu)
            score(model, ref_model, prec, batch, args)                          # 2. pi_old
            run.check_finite(step, batch)
            stats = grpo_step(model, opt, scaler, prec, batch, args)            # 3. update
            if "nonfinite" in stats:
                run.halt(step, stats["nonfinite"])
            t_sync = sync_weights(llm, hf_named_tensors(model), prec.dtype)     # 4. sync
            rec = log_step(step, batch, stats, t_sync, t0)                      # 5. log
            if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
                rec["eval_accuracy"] = evaluate(llm, args, step)
            rec["time_step_s"] = time.perf_counter() - t0
            run.record(step, rec, stop)
            if stop:
                print(f"{stop['signal']}: stopped after step {step}; checkpoint and metrics are in {args.out}; "
                      f"continue with --resume")
                return None
        return run.finish()


def get_args(argv=None):
    return finish_args(make_parser(__doc__.split("\n")[1]).parse_args(argv), training=True)


def finish_args(args, training, json_out=None):
    """Fill in the derived settings, refuse bad input, then make the problem generators."""
    args.max_new_tokens = args.max_new_tokens or 2 * args.n_items + 8
    args.out = args.out or os.path.join("runs", str(args.dtype))
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    try:
        get_precision(args.dtype)  # e.g. bf16 on a GPU without it
        model_config(args)         # e.g. a head size vLLM cannot serve
    except ValueError as e:
        fail(str(e).replace("n_embd/n_head", "--n-embd/--n-head"))
    check_args(args, training, json_out)
    args.train_problems, args.eval_problems = task.make_splits(args.seed, args.n_items, args.n_eval)
    return args


if __name__ == "__main__":
    train(get_args())
