"""
grpo.py: GRPO with a GradScaler, by hand (step 3 of the loop): advantages, the normaliser,
the loss (PPO-clip; each correction a weight on it), and the optimizer step.
It teaches: the samples come from the engine (mu), the objective from the trainer (pi). The
unbiased gradient is E_mu[(pi / mu) A grad log pi]. GRPO leaves out the weight pi / mu,
which would be 1 if the two agreed; the mismatch makes it differ from 1, and leaving it out
is the bias the dtype sets. The patches put a weight back; the paper's fix is fp16.
Left out: a KL penalty, a value network (the paper's runs use neither), entropy bonuses.
"""
import math
from dataclasses import dataclass

import torch

import task
from model import token_logprobs

# The paper's algorithms, and its caps C on their weights (its oat scripts' values)
ALGORITHMS = ("grpo", "token-tis", "seq-mis", "pg-seq-is", "pg-seq-mis", "gspo")
CAPS = {"token-tis": 2.0, "seq-mis": 10.0, "pg-seq-mis": 3.0}
CLIP_EPS = 0.2            # PPO's clip range
GSPO_CLIP = (3e-4, 4e-4)  # GSPO's, below and above 1 (the GSPO paper's)
MAX_GRAD_NORM = 1.0

@dataclass
class Update:  # what grpo_step reads of a run's flags
    algorithm: str = "grpo"  # the loss (grpo_loss)
    is_cap: float = None     # the IS weight's cap C; None: no cap
    bypass: bool = False     # pi_old = mu, the engine's log-probs (verl's bypass mode)
    dr_grpo: bool = False    # Dr. GRPO: no std; each sequence's sum over the budget
    budget: int = 32         # new tokens a response may have: Dr. GRPO's normaliser
    minibatches: int = 1     # optimizer steps per rollout batch
    seed: int = 0            # the run's: the mini-batches' shuffle

@dataclass
class Batch:
    idx: torch.Tensor      # (N, T) prompt + response ids, right-padded
    mask: torch.Tensor     # (N, T-1) 1 on the predicted response tokens
    mu_logp: torch.Tensor  # (N, T-1) the engine's log-probs of them
    adv: torch.Tensor      # (N,) the group advantages
    log: dict              # the rollout's figures, for the metrics row

    def select(self, rows):
        return Batch(self.idx[rows], self.mask[rows], self.mu_logp[rows], self.adv[rows], {})

def group_advantages(rewards, group_size, scale_by_std=True, eps=1e-6):
    """(r - group mean) / (group std + eps), G samples per prompt (Dr. GRPO: no std)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)

def loss_norm(mask, algorithm, dr_grpo, max_new_tokens):
    """(N, 1): the loss is sum_it norm_i loss_it, with norm_i
      default   1 / response tokens   DAPO's token mean
      gspo      1 / (|y_i| N)         each sequence's mean, then their mean (GSPO)
      dr_grpo   1 / (budget N)        oat's Dr. GRPO: a sum over the budget, not |y_i|"""
    n_seq = mask.shape[0]
    if dr_grpo:
        return torch.full((n_seq, 1), 1.0 / (n_seq * max_new_tokens))
    if algorithm == "gspo":
        return 1 / (mask.sum(1, keepdim=True).clamp(min=1) * n_seq)
    return torch.full((n_seq, 1), 1.0) / mask.sum().clamp(min=1)

def ppo_clip(log_r, a, lo, hi):
    """-min(r A, clip(r, 1 - lo, 1 + hi) A), r = exp(log_r); where the clip binds (no grad)."""
    ratio = torch.exp(log_r)
    per_token = -torch.min(ratio * a, ratio.clamp(1 - lo, 1 + hi) * a)
    binds = torch.where(a > 0, ratio > 1 + hi, ratio < 1 - lo)
    return per_token, ratio.detach(), binds & (a != 0)

def seq_sum(x, mask):  # (N, T) -> (N, 1): each sequence's sum
    return (x * mask).sum(1, keepdim=True)

def grpo_loss(logp, old_logp, batch, norm, algorithm="grpo", cap=None, bypass=False):
    """(loss, parts: what it did). logp: pi_theta, with gradient; old_logp: pi_old, fixed
    at the rollout; batch.mu_logp: mu; all (N, T). r = pi_theta / pi_old, w = pi_old / mu:
      grpo        -min(r A, clip(r, 1 - 0.2, 1 + 0.2) A)           PPO-clip, no weight
      gspo        the same on exp(mean_t log r), a sequence's, clip [1 - 3e-4, 1 + 4e-4]
      token-tis   grpo x min(w_t, C)                               truncated token IS
      seq-mis     grpo x prod_t w_t, 0 above C                     masked sequence IS
      pg-seq-is   -(w A) log pi_theta, w = min(prod_t pi_theta / mu, C), detached: plain PG
      pg-seq-mis  the same, w = 0 above C                          dropped, not cut
    bypass (pi_old = mu, verl's): r already is pi_theta / mu; token-tis would count it twice
    (refused); seq-mis keeps only its mask 1[prod_t pi_theta / mu <= C]."""
    if algorithm.startswith("pg-"):
        return pg_seq_loss(logp, batch, norm, cap, drop=algorithm == "pg-seq-mis")
    mask, a = batch.mask, batch.adv[:, None]
    cap = math.inf if cap is None else cap
    lo, hi = GSPO_CLIP if algorithm == "gspo" else (CLIP_EPS, CLIP_EPS)
    log_r = logp - old_logp
    if algorithm == "gspo":  # one ratio a sequence: its mean per-token log-ratio
        log_r = seq_sum(log_r, mask) / mask.sum(1, keepdim=True).clamp(min=1)
    per_token, ratio, binds = ppo_clip(log_r, a, lo, hi)
    parts = {"ratio": ratio, "clipped": binds}
    pi_logp = logp.detach() if bypass else old_logp
    if algorithm == "token-tis":
        w = torch.exp((pi_logp - batch.mu_logp) * mask)
        per_token = per_token * correction(w, cap)
        parts.update(is_weight=w, is_over_cap=w > cap)
    elif algorithm == "seq-mis":
        w = torch.exp(seq_sum(pi_logp - batch.mu_logp, mask))
        keep = w <= cap  # bypass: r already carries w, only the mask is left
        per_token = per_token * (keep if bypass else correction(w, cap, drop=True))
        parts.update(is_weight=w, is_over_cap=~keep)
    return total(per_token, mask, norm), parts

def pg_seq_loss(logp, batch, norm, cap, drop):
    """-(w A) log pi_theta, w = prod_t pi_theta / mu (detached), cut at the cap or dropped."""
    mask, a = batch.mask, batch.adv[:, None]
    cap = math.inf if cap is None else cap
    w = torch.exp(seq_sum(logp.detach() - batch.mu_logp, mask))
    per_token = -(correction(w, cap, drop) * a) * logp
    return total(per_token, mask, norm), {"is_weight": w, "is_over_cap": w > cap}

def correction(w, cap, drop=False):  # an IS weight cut at the cap (TIS), or 0 above it (MIS)
    return torch.where(w <= cap, w, 0.0) if drop else w.clamp(max=cap)

def total(per_token, mask, norm):
    # float32 (log_softmax's, whatever the trainer's dtype): 12,000 terms don't sum in 16 bits
    return (per_token * mask * norm).sum()

def optimizer_step(model, opt, scaler, loss):
    """(grad norm, skipped). fp16: loss x scale, so small gradients survive a 16-bit
    backward; unscale_ before the clip; step() skips an inf/nan gradient and update() halves
    the scale (doubles it after clean steps). bf16, fp32: pass-through; inf/nan skipped too."""
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item()
    scale_before, finite = scaler.get_scale(), math.isfinite(grad_norm)
    if scaler.is_enabled() or finite:
        scaler.step(opt)
    scaler.update()
    lowered = scaler.get_scale() < scale_before  # fp16: the scaler skipped the step
    return grad_norm, lowered if scaler.is_enabled() else not finite

def minibatch_rows(n, update, step):
    """n rows in update.minibatches near-equal parts, shuffled as oat does."""
    if update.minibatches == 1:
        return [torch.arange(n)]
    g = torch.Generator().manual_seed(task.seed_of("minibatch", update.seed, step))
    return list(torch.randperm(n, generator=g).tensor_split(update.minibatches))

def grpo_step(model, opt, scaler, prec, batch, trainer_logp, update, step, observe=None):
    """Step 3: an optimizer step per mini-batch; observe (experiments/) sees the loss."""
    old_logp = batch.mu_logp if update.bypass else trainer_logp
    done = []  # (loss, grad norm, skipped, parts, rows) per optimizer step
    for rows in minibatch_rows(len(batch.adv), update, step):
        norm = loss_norm(batch.mask[rows], update.algorithm, update.dr_grpo, update.budget)
        # A = 0 adds exactly 0 to loss and gradient: out of the forward, not the normaliser
        keep = batch.adv[rows] != 0
        keep = keep if keep.any() else torch.ones_like(keep)
        kept = rows[keep]
        logp = token_logprobs(prec.logits_fn(model), batch.idx[kept])
        loss, parts = grpo_loss(logp, old_logp[kept], batch.select(kept), norm[keep],
                                update.algorithm, update.is_cap, update.bypass)
        grad_norm, skipped = optimizer_step(model, opt, scaler, loss)  # inf/nan: skipped
        done.append((loss.item(), grad_norm, skipped, parts, kept))
    losses, norms, skips, parts, kept = zip(*done)
    rows = torch.cat(kept)
    together = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    seen = batch.adv[rows], batch.mask[rows], update.algorithm
    stats = observe.loss(together, *seen) if observe else {}
    no_clip = torch.zeros(len(rows), 1)  # pg-seq-*; gspo's clip counts on each of its tokens
    clipped = together.get("clipped", no_clip).expand_as(seen[1])
    clip = (clipped * seen[1]).sum().item() / batch.mask.sum().clamp(min=1).item()
    # One loss and grad norm per optimizer step, on near-equal mini-batches: their mean
    return {"loss": sum(losses) / len(losses), **stats, "grad_norm": sum(norms) / len(norms),
            "step_skipped": any(skips), "loss_scale": scaler.get_scale(),
            "clip_frac": clip, "actor/pg_clipfrac": clip, "clip_ratio/region_mean": clip}
