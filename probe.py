"""
probe.py: the offline experiments. No training: fixed weights (the warm start, or --init DIR, e.g. a
finished run's hf/), the real engine in each dtype, the trainer beside it.

    python probe.py mismatch --json runs/probe.json   # the paper's offline test: every engine x trainer dtype
    python probe.py scaler   --json runs/scaler.json  # the GradScaler at work on one real fp16 backward
    python probe.py audit    --json runs/audit.json   # how far the mismatch biases GRPO's gradient

What it teaches: how big the training-inference mismatch is (mismatch), why fp16 training needs loss
scaling at all (scaler), and how much the mismatch actually moves an update next to the policy
gradient's own noise (audit). Every result records the machine it ran on: the engine's 16-bit kernels,
and so the numbers, depend on the chip.
"""
import json
import math

import torch

import task
from model import hf_named_tensors, load_hf, token_logprobs
from precision import INIT_SCALE, get_precision, machine, machine_line, mismatch_metrics
from rollout import generate, require_vllm, start_engine, sync_weights
from harness import number, write_atomic
from train_grpo import (finish_args, grpo_loss, group_advantages, make_parser, model_config, pack,
                        problems_for_step, warm_start)

DTYPES = ("fp32", "bf16", "fp16")
# The trainer's ways of computing: the 16-bit module (what a run uses, as verl/DeepSpeed do) and the
# gentler autocast over float32 weights and residual stream, to show what the residual stream adds.
TRAINERS = ("fp32", "bf16", "fp16", "bf16-autocast", "fp16-autocast")


def trainer_forward(model, trainer, device):
    prec = get_precision(trainer.split("-")[0], device)
    return prec.autocast_forward(model) if trainer.endswith("autocast") else prec.forward(model)


def setup(args, engine=None):
    """The starting weights and a function dtype -> an engine serving them (`engine`: the tests' shared
    engines, reused; the weights are synced in). Every engine stays referenced until the end:
    destroying an in-process vLLM engine tears down process-wide state that the others still use."""
    require_vllm()
    device = get_precision("fp32").device
    ckpt = args.init or warm_start(args, model_config(args), device)[0]
    model = load_hf(ckpt, device)
    engines = {}

    def get_engine(name):
        prec = get_precision(name, device)
        if name not in engines:
            engines[name] = engine(prec.vllm_dtype) if engine else start_engine(
                ckpt, prec.vllm_dtype, args.seed, args.max_seq_len, args.gpu_memory_utilization)
        sync_weights(engines[name], hf_named_tensors(model), prec.dtype)
        return engines[name]
    return ckpt, model, device, get_engine


def sample(llm, prompts, args, seed, device):
    """The engine samples --group-size responses per prompt; returns (samples, idx, mask, mu)."""
    torch.manual_seed(seed)  # the in-process engine samples from the global generator: same numbers per dtype
    samples = generate(llm, prompts, args.group_size, args.max_new_tokens, task.EOS_ID)
    idx, mask, mu = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device,
                         [s.logprobs for s in samples])
    return samples, idx, mask, mu


# ---------------------------------------------------------------------------------------------------
# 1. The mismatch (the paper's offline test)

def mismatch(args, engine=None):
    """Every engine dtype against every trainer mode on the same weights. Each engine samples
    --group-size responses to each held-out prompt under the same seed; the trainer scores the same
    tokens each way. The matched rows are what a run in that dtype sees; the mixed rows (one side
    fp32) show whose rounding it is; the autocast rows how much the 16-bit residual stream adds."""
    ckpt, model, device, get_engine = setup(args, engine)
    model.eval()
    prompts = [task.prompt_ids(p) for p, _ in args.eval_problems]
    width = math.ceil(args.max_new_tokens / 4)  # four buckets of response positions
    rows, by_pos, tokens = [], [], {}
    for eng in DTYPES:
        _, idx, mask, mu = sample(get_engine(eng), prompts, args, args.seed, device)
        pos = (mask.cumsum(1) - 1) * mask  # position of each predicted token within its response
        for tr in TRAINERS:
            with torch.no_grad():
                pi = token_logprobs(trainer_forward(model, tr, device), idx)
            rows.append({"engine": eng, "trainer": tr, **mismatch_metrics(mu, pi, mask)})
            if tr == eng:  # every sampled token's (mu, pi), for the scatter figure (plot.py --probe)
                tokens[eng] = {"mu": mu[mask.bool()].tolist(), "pi": pi[mask.bool()].tolist()}
            for lo in range(0, args.max_new_tokens, width):
                in_bucket = mask * (pos >= lo) * (pos < lo + width)
                if in_bucket.sum() > 0:
                    by_pos.append({"engine": eng, "trainer": tr, "positions": f"{lo}-{lo + width - 1}",
                                   "tokens": int(in_bucket.sum()), **mismatch_metrics(mu, pi, in_bucket)})
    matched = {r["engine"]: r for r in rows if r["engine"] == r["trainer"]}
    # k1 is signed (its errors cancel), so a ratio of it means nothing; every other metric is >= 0.
    ratio = {k: matched["bf16"][k] / matched["fp16"][k] for k in matched["fp16"]
             if k.startswith("mismatch_") and k != "mismatch_k1"}
    result = {"experiment": "mismatch", "checkpoint": ckpt, "machine": machine(),
              "sequences_per_engine": len(prompts) * args.group_size, "rows": rows, "by_position": by_pos,
              "bf16_over_fp16": ratio, "tokens": tokens}

    keys = [k for k in rows[0] if k.startswith("mismatch_")]
    print(f"\nmismatch between engine (mu) and trainer (pi) on {ckpt}, {result['sequences_per_engine']} "
          f"sampled responses per engine\n{machine_line(result['machine'])}\n")
    print(f"{'engine':7} {'trainer':13} " + " ".join(f"{k[9:]:>15}" for k in keys))
    for r in rows:
        print(f"{r['engine']:7} {r['trainer']:13} " + " ".join(f"{r[k]:>15.3e}" for k in keys))
    print(f"{'bf16 / fp16 (matched)':21} " + " ".join(f"{ratio[k]:>15.1f}" if k in ratio else f"{'-':>15}"
                                                     for k in keys) + "   (the paper: ~24x)")
    print("\nby position in the response, matched dtypes: tokens, token k3, mean |log mu - log pi|")
    print(f"{'positions':10} " + " ".join(f"{d:>28}" for d in DTYPES))
    for b in sorted({r["positions"] for r in by_pos}, key=lambda s: int(s.split("-")[0])):
        cells = {r["engine"]: r for r in by_pos if r["positions"] == b and r["engine"] == r["trainer"]}
        print(f"{b:10} " + " ".join(f"{cells[d]['tokens']:>7} {cells[d]['mismatch_k3']:>10.2e} "
                                    f"{cells[d]['mismatch_logp_abs_mean']:>9.2e}" if d in cells else f"{'-':>28}"
                                    for d in DTYPES))
    return result


# ---------------------------------------------------------------------------------------------------
# 2. The GradScaler at work

def flat_grad(model, loss):
    """The gradient of `loss` in the float32 master weights, as one vector."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def scaler(args, engine=None):
    """One real GRPO batch of the warm start (the fp16 engine's samples, their rewards and advantages):
    its policy gradient computed by the 16-bit trainer at several loss scales, against float32's.
    Without scaling, fp16's backward rounds the many tiny gradient entries (a token-mean over ~12,000
    tokens) to zero; the GradScaler's 2**16 keeps them; too large a scale overflows to inf."""
    ckpt, model, device, get_engine = setup(args, engine)
    probs = problems_for_step(args, 0, args.batch_size)
    samples, idx, mask, mu = sample(get_engine("fp16"), [task.prompt_ids(p) for p, _ in probs], args, args.seed, device)
    answers = [a for _, a in probs for _ in range(args.group_size)]
    adv = group_advantages(torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)]),
                           args.group_size).to(device)

    def grad(name, scale):
        """(gradient of the logits as the backward's first 16-bit tensor holds it, still scaled;
        gradient of the master weights, unscaled in float32 as GradScaler.unscale_ does)."""
        forward, seen = get_precision(name, device).forward(model), {}

        def forward_keeping_logit_grad(x):
            logits = forward(x)
            logits.register_hook(lambda g: seen.update(logits=g))  # returns None: g goes on unchanged
            return logits
        logp = token_logprobs(forward_keeping_logit_grad, idx)
        loss, _ = grpo_loss(logp, logp.detach(), mu, adv, mask)  # one step's loss: ratio 1, the plain policy gradient
        g = flat_grad(model, loss * scale) / scale
        return seen["logits"], g

    def underflow(g, exact):
        """Of the entries non-zero in float32: the fraction stored as 0 (lost) and as 0 or a subnormal
        number (below the dtype's smallest normal, so with fewer than its mantissa bits: underflowed)."""
        n = max(1, (exact != 0).sum().item())
        return (((g == 0) & (exact != 0)).sum().item() / n,
                ((g.abs() < torch.finfo(g.dtype).tiny) & (exact != 0)).sum().item() / n)

    exact_logits, exact = grad("fp32", 1.0)
    rows = []
    for name, scale in [("bf16", 1.0), ("fp16", 1.0), ("fp16", 2.0 ** 8), ("fp16", INIT_SCALE), ("fp16", 2.0 ** 24)]:
        g_logits, g = grad(name, scale)
        finite = bool(torch.isfinite(g).all())
        zero, sub = underflow(g_logits, exact_logits)
        rows.append({"dtype": name, "loss_scale": scale, "finite": finite, "logit_grad_zero": zero,
                     "logit_grad_underflow": sub, "weight_grad_zero": underflow(g, exact)[0],
                     "rel_error": ((g - exact).norm() / exact.norm()).item() if finite else None})
    result = {"experiment": "scaler", "checkpoint": ckpt, "machine": machine(), "sequences": len(samples),
              "tokens": int(mask.sum()), "rows": rows}
    print(f"\nthe policy gradient of one GRPO batch ({len(samples)} sequences, {result['tokens']} tokens) on {ckpt}"
          f"\n{machine_line(result['machine'])}\nagainst float32's. Of the entries non-zero in float32, the share"
          f"\nstored as exactly 0, or as 0 or a subnormal number (underflowed):\n")
    print(f"{'trainer':8} {'loss scale':>10} {'logit grad: 0':>14} {'underflowed':>12} {'weight grad: 0':>15} "
          f"{'weight grad: rel. error':>24}")
    for r in rows:
        err = f"{r['rel_error']:>24.2e}" if r["finite"] else f"{'inf (overflow)':>24}"
        print(f"{r['dtype']:8} {r['loss_scale']:>10.0f} {r['logit_grad_zero']:>14.1%} {r['logit_grad_underflow']:>12.1%} "
              f"{r['weight_grad_zero']:>15.2%} {err}")
    return result


# ---------------------------------------------------------------------------------------------------
# 3. The gradient-bias audit: how far the mismatch moves GRPO's update, next to the update's own noise

PI_BUCKETS = (0.0, 0.01, 0.1, 0.5, 0.9, 1.0)  # the trainer's token probability, for the per-token table


def audit_losses(logp, pi_logp, mu_logp, adv, mask, n_tokens):
    """On samples from the engine (mu): GRPO's objective J = sum_i A_i sum_t log pi(y_it) / N_tokens,
    and the mismatch's part of it, J_bias = sum_i (1 - w_i) A_i sum_t log pi(y_it) / N_tokens, where
    w_i = prod_t pi / mu is sequence i's importance weight (detached). grad J is the gradient vanilla
    GRPO follows; grad J - grad J_bias = grad of sum_i w_i A_i ... is the importance-weighted gradient,
    unbiased for pi; so d = grad J_bias is the bias the mismatch adds on these samples. Returns
    (J, J_bias, w). logp carries the gradient; pi_logp (the trainer's, in the run's dtype) does not."""
    w = torch.exp(((pi_logp - mu_logp) * mask).sum(1)).detach()
    per_seq = (logp * mask).sum(1)
    return (adv * per_seq).sum() / n_tokens, ((1 - w) * adv * per_seq).sum() / n_tokens, w


def audit(args, engine=None):
    """For each dtype (engine and trainer in it, as a run uses them), over --batches independent
    batches of the engine's samples: g (GRPO's gradient) and d (its bias, audit_losses) per batch.
    Gradients are taken through the float32 forward at the same weights, so d holds the mismatch
    alone (where the samples came from, mu, and how pi weighs them), not the 16-bit backward's own
    rounding, which `scaler` measures. From the K batches:
      mean d, with its standard error (the size |mean d| would have from noise alone, sqrt(tr Cov d / K));
      |b|: the bias's norm, that noise removed (|mean d|^2 - tr Cov d / K, an unbiased estimate of |b|^2);
      sigma = sqrt(tr Cov g): the batch-to-batch noise of one step's gradient;
      |E g|: the mean gradient's norm, its noise part removed (|mean g|^2 - tr Cov g / K);
      steps = (sigma / |b|)^2: after n steps of the same bias, it sums to n|b| while the noise sums to
      sqrt(n) sigma; they are equal at n = steps. That assumes the bias keeps its direction from step
      to step, the noise is independent between steps, and the updates add up linearly (no Adam
      rescaling, the weights barely moving): an order of magnitude, not a prediction."""
    ckpt, model, device, get_engine = setup(args, engine)
    params = [p for p in model.parameters()]
    rows, buckets = [], []
    for name in DTYPES:
        prec, llm = get_precision(name, device), get_engine(name)
        acc = {k: torch.zeros(sum(p.numel() for p in params), dtype=torch.float64) for k in ("g", "g2", "d", "d2")}
        tok = {"pi": [], "d": []}
        w_dev, k3 = [], []
        for k in range(args.batches):
            probs = problems_for_step(args, f"audit-{k}", args.batch_size)
            # the same prompts and random numbers for every dtype (stream 2 of train_grpo.seed_engine_sampling)
            seed = args.rl_seed * 1_000_003 + 2 * 999_983 + k
            samples, idx, mask, mu = sample(llm, [task.prompt_ids(p) for p, _ in probs], args, seed, device)
            answers = [a for _, a in probs for _ in range(args.group_size)]
            adv = group_advantages(torch.tensor([task.reward(s.response_ids, a) for s, a in zip(samples, answers)]),
                                   args.group_size).to(device)
            with torch.no_grad():
                pi = token_logprobs(prec.forward(model), idx)  # the trainer's pi, in the run's dtype
            J, J_bias, w = audit_losses(token_logprobs(model, idx), pi, mu, adv, mask, mask.sum())
            g = torch.cat([x.flatten() for x in torch.autograd.grad(J, params, retain_graph=True)]).double()
            d = torch.cat([x.flatten() for x in torch.autograd.grad(J_bias, params)]).double()
            for key, v in (("g", g), ("g2", g * g), ("d", d), ("d2", d * d)):
                acc[key] += v  # float64 sums: tr Cov is a small difference of large sums
            w_dev.append((w - 1).abs().mean().item())
            k3.append(mismatch_metrics(mu, pi, mask)["mismatch_k3"])
            tok["pi"].append(pi[mask.bool()].exp())
            tok["d"].append((mu - pi)[mask.bool()])
        K = args.batches
        mean_g, mean_d = acc["g"] / K, acc["d"] / K
        tr_cov_g = ((acc["g2"] - K * mean_g ** 2).sum() / (K - 1)).clamp(min=0).item()
        tr_cov_d = ((acc["d2"] - K * mean_d ** 2).sum() / (K - 1)).clamp(min=0).item()
        d_norm, g_norm = mean_d.norm().item(), mean_g.norm().item()
        # |mean x|^2 overstates |E x|^2 by the noise's tr Cov / K; subtracting it gives an unbiased estimate
        b, eg = math.sqrt(max(d_norm ** 2 - tr_cov_d / K, 0.0)), math.sqrt(max(g_norm ** 2 - tr_cov_g / K, 0.0))
        sigma = math.sqrt(tr_cov_g)
        rows.append({"dtype": name, "batches": K, "mean_d_norm": d_norm, "bias_se": math.sqrt(tr_cov_d / K),
                     "bias_norm": b, "grad_noise": sigma, "grad_mean_norm": eg,
                     "bias_over_noise": b / sigma if sigma else None, "bias_over_grad": b / eg if eg else None,
                     "cos_bias_grad": (mean_d @ mean_g).item() / (d_norm * g_norm + 1e-300),
                     "steps_to_match_noise": (sigma / b) ** 2 if b else None,
                     "seq_weight_abs_dev": sum(w_dev) / K, "mismatch_k3": sum(k3) / K})
        pi_all, d_all = torch.cat(tok["pi"]), torch.cat(tok["d"]).double()
        for lo, hi in zip(PI_BUCKETS[:-1], PI_BUCKETS[1:]):
            sel = (pi_all >= lo) & (pi_all < hi) if hi < 1 else (pi_all >= lo)
            n = int(sel.sum())
            buckets.append({"dtype": name, "pi": f"{lo}-{hi}", "tokens": n,
                            "mean_signed": d_all[sel].mean().item() if n else None,
                            "signed_se": (d_all[sel].std() / math.sqrt(n)).item() if n > 1 else None,
                            "mean_abs": d_all[sel].abs().mean().item() if n else None})
    result = {"experiment": "audit", "checkpoint": ckpt, "machine": machine(), "response_tokens": args.max_new_tokens,
              "sequences_per_batch": args.batch_size * args.group_size, "rows": rows, "by_pi": buckets}
    print(f"\ngradient-bias audit on {ckpt}: {args.batches} batches x {result['sequences_per_batch']} sequences per dtype"
          f"\n{machine_line(result['machine'])}\n")
    print(f"{'dtype':6} {'|mean d|':>9} {'s.e.':>9} {'|b|':>9} {'sigma':>9} {'|E g|':>9} {'|b|/sigma':>10} {'|b|/|Eg|':>9} "
          f"{'cos(b,Eg)':>9} {'steps':>10} {'|w - 1|':>9} {'k3':>9}")
    for r in rows:
        ratio = f"{r['bias_over_grad']:>9.1e}" if r["bias_over_grad"] is not None else f"{'-':>9}"
        steps = f"{r['steps_to_match_noise']:>10.2e}" if r["steps_to_match_noise"] else f"{'-':>10}"
        noise = f"{r['bias_over_noise']:>10.1e}" if r["bias_over_noise"] is not None else f"{'-':>10}"
        print(f"{r['dtype']:6} {r['mean_d_norm']:>9.2e} {r['bias_se']:>9.2e} {r['bias_norm']:>9.2e} {r['grad_noise']:>9.2e} "
              f"{r['grad_mean_norm']:>9.2e} {noise} {ratio} {r['cos_bias_grad']:>9.2f} "
              f"{steps} {r['seq_weight_abs_dev']:>9.1e} {r['mismatch_k3']:>9.1e}")
    print("\nper token, by the trainer's probability pi: tokens, mean (log mu - log pi) / its s.e., mean |log mu - log pi|")
    print(f"{'pi':9} " + " ".join(f"{d:>36}" for d in DTYPES))
    for bucket in dict.fromkeys(r["pi"] for r in buckets):
        cells = {r["dtype"]: r for r in buckets if r["pi"] == bucket}
        print(f"{bucket:9} " + " ".join(f"{c['tokens']:>8} {c['mean_signed']:>+10.2e} {c['mean_signed'] / c['signed_se']:>+5.1f}"
                                      f" {c['mean_abs']:>10.2e}" if c["tokens"] > 1 and c["signed_se"] else
                                      f"{c['tokens']:>8} {'-':>10} {'-':>5} {'-':>10}" for c in cells.values()))
    return result


def get_args(argv=None):
    p = make_parser(__doc__.split("\n")[1])
    p.add_argument("experiment", nargs="?", default="mismatch", choices=["mismatch", "scaler", "audit"],
                   help="which experiment (see the docstring)")
    p.add_argument("--batches", type=number(int, low=2, low_ok=True), default=20,
                   help="audit: independent batches (K) per dtype")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    return finish_args(args, training=False, json_out=args.json)


def main(argv=None, engine=None):
    args = get_args(argv)
    result = {"mismatch": mismatch, "scaler": scaler, "audit": audit}[args.experiment](args, engine)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))
        print(f"\nwritten to {args.json}")
    return result


if __name__ == "__main__":
    main()
