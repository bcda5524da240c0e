r"""
experiments/audit.py: the gradient-bias audit. How far the mismatch moves GRPO's gradient,
against one step's noise, at fixed weights.

    python experiments/audit.py --json figures/audit.json          # per dtype
    M=results/MACHINE                                               # the dial's prediction:
    python experiments/audit.py --dial-doses 0 1 3 10 30 100 --dial-calibration $M/dial.json \
        --json $M/dial-audit-uniform.json

For each dtype (engine and trainer in it), --batches independent batches of the engine's
samples (the RL run's first --batches rollouts, at fixed weights): g (GRPO's gradient) and d
(its bias, audit_losses) per batch, through the float32 forward at the same weights, so d
holds the mismatch alone, not the 16-bit backward's rounding (scaler.py measures that). The
K vectors of each kind are kept; their Gram matrices give every figure and its interval.
With --dial-doses: the bf16 trainer on the engine's kernels (no mismatch of its own) against
a bf16 engine perturbed by the mismatch dial (dial.py) at each dose: the prediction for the
dial's runs, committed before them (dial_figure.py draws it beside them).
With --loss gspo-engine: the same figures for gspo-engine's first update (GSPO, pi_old = mu),
d its gradient with pi_old = mu less its gradient with pi_old = pi (every ratio 1, nothing
clipped). With --variant: that bf16 variant's kernels alone (its library, AMX, the trainer's
site rounding; variants.py's record; one a process), e.g. the sites' (sites-audit.md):

    python experiments/audit.py --loss gspo-engine --variant bf16-noamx-site-trunc \
        --json results/MACHINE/sites/audit/bf16-noamx-site-trunc-s0.json
"""
import json
import math
import os

import numpy as np
import torch

import common  # first: it puts the core on sys.path
import task
from common import fmt, t_quantile
from instruments import machine
from model import token_logprobs
from grpo import grpo_loss, loss_norm
from offline import (DTYPES, base_parser, install_kernels, mismatch_metrics, parse, rl_args,
                     setup)
from variants import BF16, DIAL_SHAPES, VARIANTS, runs_on
from precision import get_precision
from rollout import start_engine
from train_grpo import rollout  # the loop's step 1: a run's own batches
from warm_start import model_config

# The variants --variant takes: bf16 whose record differs from bf16's in its kernels alone
KERNEL_VARIANTS = [v.name for v in VARIANTS.values() if v.flags == BF16 and not (
    v.dial or v.swap or v.rotary_torch)]

def audit_losses(logp, pi_logp, mu_logp, adv, mask, n_tokens):
    """On samples from mu: GRPO's J = sum_i A_i sum_t log pi(y_it) / N_tokens and the
    mismatch's part, J_bias = sum_i (1 - w_i) A_i sum_t log pi(y_it) / N_tokens, with
    w_i = prod_t pi / mu (detached): grad J - grad J_bias is unbiased for pi, so
    d = grad J_bias is the bias. Returns (J, J_bias, w)."""
    w = torch.exp(((pi_logp - mu_logp) * mask).sum(1)).detach()
    per_seq = (logp * mask).sum(1)
    return (adv * per_seq).sum() / n_tokens, ((1 - w) * adv * per_seq).sum() / n_tokens, w

def gspo_audit_losses(logp, pi_logp, batch, budget):
    """gspo-engine's first update (the loop's grpo_loss, GSPO): J with pi_old = mu, as its
    runs take it, and with pi_old = pi, where every ratio is 1 and nothing clips. The ratio's
    value comes from the trainer in its dtype (pi_logp), its gradient through the float32
    logp, so d holds the mismatch alone. Returns (J_pi, J_bias = J_mu - J_pi, clipped)."""
    through = logp - logp.detach() + pi_logp  # value pi_logp, gradient logp's
    norm = loss_norm(batch.mask, "gspo", False, budget)
    loss_mu, parts = grpo_loss(through, batch.mu_logp, batch, norm, "gspo", bypass=True)
    loss_pi, _ = grpo_loss(through, pi_logp, batch, norm, "gspo")
    return -loss_pi, loss_pi - loss_mu, parts["clipped"]

def bias_statistics(G_dd, G_gg, G_dg):
    """From the K x K Gram matrices of the per-batch bias vectors d_k and gradients g_k
    (G_dg[j, k] = d_j . g_k), each statistic as an unbiased pairwise estimate over distinct
    batches (so no batch's noise is counted against itself):
      b2        |E d|^2 = mean over j != k of d_j . d_k  (< 0: |b| is not resolved)
      eg2       |E g|^2, the same for g
      sigma2    tr Cov g, one step's noise in all directions
      b_dot_eg  E d . E g = mean over j != k of d_j . g_k  (one batch's d, g share noise)
      noise_along_b  Var_k(g_k . b_hat_k), b_hat_k the direction of the other batches'
                     summed d: the noise along the bias, each batch against a direction it
                     did not help estimate."""
    K = G_dd.shape[0]
    off = ~torch.eye(K, dtype=torch.bool)
    def pair(G):
        return G[off].mean().item()

    sigma2 = (G_gg.trace() - G_gg.sum() / K).item() / (K - 1)
    along = []
    for k in range(K):
        others = torch.arange(K) != k
        along.append((G_dg[others, k].sum() / G_dd[others][:, others].sum().sqrt()).item())
    return {"b2": pair(G_dd), "eg2": pair(G_gg), "sigma2": sigma2, "b_dot_eg": pair(G_dg),
            "noise_along_b": float(np.var(along, ddof=1))}

def derived(s):
    """|b|, |b| / sigma, cos(b, E g), and the steps after which a bias that kept its direction
    would match the summed noise: (sigma / |b|)^2 against all ~0.9M directions' noise (an
    upper bound), noise_along_b / |b|^2 against the noise along the bias alone."""
    positive = s["b2"] > 0  # else |b| is not resolved
    b = math.sqrt(s["b2"]) if positive else 0.0
    cos = s["b_dot_eg"] / (b * math.sqrt(s["eg2"])) if b and s["eg2"] > 0 else None
    return {"bias_norm": b, "bias_over_noise": b / math.sqrt(s["sigma2"]),
            "grad_mean_norm": math.sqrt(max(s["eg2"], 0)), "cos_bias_grad": cos,
            "steps_upper": s["sigma2"] / s["b2"] if positive else None,
            "steps_along": s["noise_along_b"] / s["b2"] if positive else None}

def jackknife(G_dd, G_gg, G_dg):
    """Every statistic and figure with its own 95 % jackknife interval: the figure itself
    recomputed with each batch left out, t quantile with K - 1 dof; none where a leave-one-out
    leaves it undefined (|b|^2 <= 0). A bias is resolved when |b|^2's interval excludes 0."""
    K = G_dd.shape[0]

    def figures(keep):
        s = bias_statistics(*(G[keep][:, keep] for G in (G_dd, G_gg, G_dg)))
        return {**s, **derived(s)}

    full = figures(torch.ones(K, dtype=torch.bool))
    leave = [figures(torch.arange(K) != i) for i in range(K)]
    out = dict(full)
    for k, v in full.items():
        values = [s[k] for s in leave]
        if v is None or None in values:
            continue
        values = np.array(values)
        se = math.sqrt((K - 1) / K * ((values - values.mean()) ** 2).sum())
        out[k + "_ci"] = (v - t_quantile(K - 1) * se, v + t_quantile(K - 1) * se)
    out["resolved"] = out["b2_ci"][0] > 0
    return out

def audit(args, engine=None):
    """The audit's rows: per dtype, or per dose of the dial (the module docstring)."""
    library = install_kernels(args)  # before any engine: one configuration a process
    ckpt, model, device, get_engine = setup(args, engine)
    train_batch = task.make_splits(args.seed, args.n_items, task.N_EVAL)[1]
    rows = []
    for name in () if args.dial_doses else args.dtypes:
        prec, llm = get_precision(name, device=device), get_engine(name)
        rows.append({"dtype": name, **audit_row(model, prec, llm, train_batch, args, device)})
    if args.dial_doses:
        rows = dial_rows(ckpt, model, train_batch, args, device)
    result = {"experiment": "audit", "checkpoint": ckpt, "machine": machine(),
              "loss": args.loss, "variant": args.variant, "kernel_library": library,
              "amx_hidden": args.hide_amx, "site_rounding": args.site_rounding,
              "max_new_tokens": args.max_new_tokens,
              "sequences_per_batch": args.batch_size * args.group_size, "rows": rows}
    print_audit(result)
    return result

def dial_rows(ckpt, model, train_batch, args, device):
    """The bf16 trainer on the engine's kernels against the dialed bf16 engine, per dose."""
    import dial  # vLLM's logits processor: only when asked

    calibration = json.load(open(args.dial_calibration))
    cfg = model_config(args.n_items, args.max_new_tokens)
    llm = start_engine(ckpt, "bfloat16", args.seed, cfg.max_seq_len, **dial.engine_args(1.0))
    aligned, rows = get_precision("bf16", device=device, kernels="engine"), []
    for dose in args.dial_doses:
        sigma = dial.sigma_for(calibration, args.dial_shape, dose)
        dial.configure(sigma, args.dial_shape, calibration["profile"])
        row = audit_row(model, aligned, llm, train_batch, args, device)
        rows.append({"dtype": f"dial{dose}", "dial_dose": dose, "dial_shape": args.dial_shape,
                     "dial_sigma": sigma, "dial_unit": calibration["unit"], **row})
    dial.configure(0.0)
    return rows

def audit_row(model, prec, llm, train_batch, args, device):
    """One mode's figures over --batches batches (the same prompts and random numbers for
    every mode)."""
    params = list(model.parameters())
    gs, ds, k3, dev = [], [], [], []
    for k in range(args.batches):
        b = rollout(llm, train_batch, rl_args(args), k, device)
        with torch.no_grad():  # the trainer's pi, in the run's dtype
            pi = token_logprobs(prec.logits_fn(model), b.idx)
        logp = token_logprobs(model, b.idx)  # float32: d holds the mismatch alone
        if args.loss == "gspo-engine":  # dev: the share of sequences the clip drops
            J, J_bias, clipped = gspo_audit_losses(logp, pi, b, args.max_new_tokens)
            dev.append(clipped.double().mean().item())
        else:  # dev: the sequences' mean |w - 1|
            J, J_bias, w = audit_losses(logp, pi, b.mu_logp, b.adv, b.mask, b.mask.sum())
            dev.append((w - 1).abs().mean().item())
        grad = torch.autograd.grad(J, params, retain_graph=True)
        gs.append(torch.cat([x.flatten() for x in grad]).double())
        ds.append(torch.cat([x.flatten() for x in torch.autograd.grad(J_bias, params)]).double())
        metrics = mismatch_metrics(b.mu_logp, pi, b.mask)
        k3.append((metrics["mismatch_k3"], metrics["mismatch_logp_abs_mean"]))
    # float64 Gram matrices: the pairwise products are small differences
    G, D = torch.stack(gs), torch.stack(ds)
    stats = jackknife(D @ D.T, G @ G.T, D @ G.T)
    dev_name = "clipped_share" if args.loss == "gspo-engine" else "seq_weight_abs_dev"
    return {"batches": args.batches, **stats, dev_name: sum(dev) / len(dev),
            "mismatch_k3": sum(x for x, _ in k3) / len(k3),
            "mismatch_logp_abs_mean": sum(y for _, y in k3) / len(k3)}

def ci(r, k):  # a figure's interval, or "-" where it has none
    return f"[{fmt(r[k + '_ci'][0])}, {fmt(r[k + '_ci'][1])}]" if k + "_ci" in r else "-"

def print_audit(result):
    print(f"\ngradient-bias audit ({result.get('loss', 'grpo')}) on {result['checkpoint']}: "
          f"{result['rows'][0]['batches']} batches x {result['sequences_per_batch']} sequences "
          f"per dtype; variant {result.get('variant')}, library {result.get('kernel_library')}, "
          f"AMX hidden {result.get('amx_hidden')}, site rounding {result.get('site_rounding')}\n"
          f"{common.machine_line(result['machine'])}\n95 % jackknife intervals over batches, "
          "each figure's own; a bias is resolved when the interval of |b|^2 excludes 0\n")
    print(f"{'dtype':5} {'|b|':>7} {'[95% CI]':>19} {'sigma':>6} {'|b|/sigma':>9} "
          f"{'[95% CI]':>19} {'cos(b,Eg)':>9} {'steps (upper)':>13} {'[95% CI]':>19} "
          f"{'steps (along b)':>15} {'[95% CI]':>19} {'|log mu-log pi|':>15}")
    for r in result["rows"]:
        print(f"{r['dtype']:5} {r['bias_norm']:>7.1e} {ci(r, 'bias_norm'):>19} "
              f"{math.sqrt(r['sigma2']):>6.3f} {r['bias_over_noise']:>9.1e} "
              f"{ci(r, 'bias_over_noise'):>19} {fmt(r['cos_bias_grad'], '+.2f'):>9} "
              f"{fmt(r['steps_upper']):>13} {ci(r, 'steps_upper'):>19} "
              f"{fmt(r['steps_along']):>15} {ci(r, 'steps_along'):>19} "
              f"{r['mismatch_logp_abs_mean']:>15.2e}")

def main(argv=None, engine=None):
    p = base_parser("the gradient-bias audit (the docstring)")
    p.add_argument("--rl-seed", type=int, default=0, help="the batches' prompts and sampling")
    p.add_argument("--batch-size", type=common.at_least(1), default=64, help="prompts per batch")
    p.add_argument("--batches", type=common.at_least(5), default=20, help="independent batches (K)")
    p.add_argument("--dial-doses", type=int, nargs="+", default=None,
                   help="the mismatch dial's doses (dial.py), instead of the dtypes")
    p.add_argument("--dial-shape", default="uniform", choices=DIAL_SHAPES)
    p.add_argument("--dial-calibration", default=None, help="--dial-doses: dial.py's JSON")
    p.add_argument("--loss", choices=("grpo", "gspo-engine"), default="grpo",
                   help="whose first update's bias: GRPO's IS bias, or GSPO's with pi_old = mu")
    p.add_argument("--variant", choices=KERNEL_VARIANTS, default=None,
                   help="bf16 with this variant's kernels (variants.py), not every dtype")
    args = parse(p, argv)
    v = VARIANTS[args.variant] if args.variant else None
    if v and not runs_on(v, machine()["cpu_isa"]):
        common.refuse(f"--variant {v.name}: not on this chip (needs {v.needs}, lacks {v.lacks})")
    args.library, args.hide_amx = (v.library, v.hide_amx) if v else (None, False)
    args.site_rounding, args.dtypes = (v.site_rounding, ["bf16"]) if v else ("rne", DTYPES)
    if args.dial_doses and not (args.dial_calibration and os.path.isfile(args.dial_calibration)):
        common.refuse("--dial-doses needs --dial-calibration FILE (experiments/dial.py calibrate)")
    return common.finish(args, audit(args, engine))

if __name__ == "__main__":
    main()
