"""
experiments/probe.py: the offline experiments. No training: fixed weights (the warm start, or
--init DIR, e.g. a finished run's hf/), the real engine in each dtype, the trainer beside it.

    python experiments/probe.py mismatch --json runs/probe.json  # the offline test, every fix
    python experiments/probe.py scaler   --json runs/scaler.json # why an fp16 trainer needs the GradScaler
    python experiments/probe.py audit    --json runs/audit.json  # GRPO's gradient bias vs noise
    python experiments/probe.py heldout  --init DIR --json F     # held-out, one fp32 engine
    python experiments/probe.py trainer  --json F                # no engine: the trainer half, GPU vs CPU
Every result records the machine: the 16-bit numbers are the chip's."""

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # the core, and this folder, from anywhere
import task  # noqa: E402
from grpo import grpo_loss, loss_norm  # noqa: E402
from instruments import machine, machine_line, pi_buckets, prefill_logprobs  # noqa: E402
from model import (
    hf_named_tensors,
    load_hf,
    pack,
    read_config,
    token_logprobs,
    write_atomic,
)  # noqa: E402
from precision import INIT_SCALE, get_precision  # noqa: E402
from precision import mismatch_metrics as basic_metrics  # noqa: E402
from rollout import generate, start_engine, sync_weights  # noqa: E402
from train_grpo import rollout  # noqa: E402  (the loop's step 1: a run's own batches)
from warm_start import model_config, warm_start  # noqa: E402

def mismatch_metrics(mu_logp, pi_logp, mask):
    """The run's mismatch metrics and, per bucket of pi, the share of tokens and their mismatch."""
    return {**basic_metrics(mu_logp, pi_logp, mask), **pi_buckets(mu_logp, pi_logp, mask)}

# Each side's way of computing: a dtype, "+head32" for the fp32 LM head (--lm-head fp32), "-aligned" for the
# trainer on the engine's kernels (--trainer-kernels engine).
ENGINES = ("fp32", "bf16", "fp16", "bf16+head32", "fp16+head32")
DTYPES = ("fp32", "bf16", "fp16")
RESAMPLES = 2000  # bootstrap resamples of the sequences, for the paired ratios' intervals

def precision_of(mode, device):
    return get_precision(
        mode.split("+")[0].split("-")[0],
        lm_head="fp32" if "+head32" in mode else "same",
        device=device,
        kernels="engine" if mode.endswith("aligned") else "torch",
    )

def trainers_of(
    eng, quick=False
):  # a dtype's engine: the plain trainers and its aligned one; a fix's engine: its trainer, and fp32
    if eng not in DTYPES:
        return (eng, "fp32")
    aligned = () if eng == "fp32" else (f"{eng}-aligned",)  # fp32 has none
    return (eng, *aligned) if quick else (*DTYPES, *aligned)

def trainer_logprobs(model, mode, idx, device):
    return token_logprobs(precision_of(mode, device).forward(model), idx)

def setup(args, engine=None):
    """The weights, and mode -> an engine serving them (`engine`: the tests' shared engines). Every
    engine stays referenced to the end: destroying an in-process vLLM engine tears down process-wide
    state the others still use."""
    device = get_precision("fp32").device
    cfg = model_config(args.n_items, args.max_new_tokens)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, device)
    model, engines = load_hf(ckpt, device).eval(), {}

    def get_engine(mode):
        prec = precision_of(mode, device)
        if mode not in engines:
            engines[mode] = (
                engine(prec.vllm_dtype, prec.head_fp32)
                if engine
                else start_engine(
                    ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32
                )
            )
        sync_weights(engines[mode], hf_named_tensors(model), prec.engine_dtype)
        return engines[mode]

    return ckpt, model, device, get_engine

def sample(llm, prompts, n, args, device):  # -> samples, idx, mask, mu, seconds
    torch.manual_seed(
        task.seed_of("probe", args.seed)
    )  # the global generator: the same numbers per engine
    t0 = time.perf_counter()
    samples = generate(llm, prompts, n, args.max_new_tokens, task.EOS_ID)
    seconds = time.perf_counter() - t0
    idx, mask, mu = pack(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        device,
        [s.logprobs for s in samples],
    )
    return samples, idx, mask, mu, seconds

def prefill(llm, samples, device):
    """The engine's prefill log-probs of the samples' response tokens, laid out as pack lays out mu."""
    lps = prefill_logprobs(
        llm,
        [s.prompt_ids + s.response_ids for s in samples],
        [len(s.prompt_ids) for s in samples],
    )
    return pack(
        [s.prompt_ids for s in samples], [s.response_ids for s in samples], device, lps
    )[2]

# ---------------------------------------------------------------------------------------------------
# 1. The mismatch, and what each fix costs

def paired_ratio(d_a, d_b, mask, seed=0):
    """mean |d_a| / mean |d_b| over the same tokens, with a 95 % percentile bootstrap interval that
    resamples whole sequences (tokens of one sequence are not independent), both rows together.
    """
    a, b, n = (
        (d_a.abs() * mask).sum(1).double().numpy(),
        (d_b.abs() * mask).sum(1).double().numpy(),
        mask.sum(1).double().numpy(),
    )
    pick = np.random.default_rng(seed).integers(0, len(n), size=(RESAMPLES, len(n)))
    boot = a[pick].sum(1) / b[pick].sum(1)
    return {
        "ratio": float(a.sum() / b.sum()),
        "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
    }

def mismatch(args, engine=None):
    """On the held-out prompts, --group-size samples each, three tables. own: each engine samples
    (timed the second time, after a warm-up) and each trainer mode scores: what a run sees.
    self: each engine's decode log-probs of its samples against its prefill of them. paired: the
    fp32 engine's samples scored by every engine's prefill and every trainer, each row over the
    bf16 row on the same tokens, with a 95 % bootstrap interval. Then each trainer mode's
    forward + backward of 512 sequences, timed, and where in the network each 16-bit trainer's
    error enters (layer_errors). --quick (a trained policy's cross-probe): the three dtypes,
    matched and aligned trainers, no costs."""
    ckpt, model, device, get_engine = setup(args, engine)
    prompts = [
        task.prompt_ids(p) for p, _ in task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    ]  # held out
    rows, self_rows, paired, speed, cost = [], [], [], {}, {}
    common = sample(get_engine("fp32"), prompts, args.group_size, args, device)
    engines = DTYPES if args.quick else ENGINES
    with torch.no_grad():
        pis = {
            tr: trainer_logprobs(model, tr, common[1], device)
            for eng in engines
            for tr in trainers_of(eng, args.quick)
        }
    base = None
    for eng in engines:
        llm = get_engine(eng)
        sample(llm, prompts, args.group_size, args, device)
        samples, idx, mask, mu, seconds = sample(llm, prompts, args.group_size, args, device)
        speed[eng] = mask.sum().item() / seconds
        self_rows.append(
            {"engine": eng, **mismatch_metrics(mu, prefill(llm, samples, device), mask)}
        )
        with torch.no_grad():
            for tr in trainers_of(eng, args.quick):
                pi = trainer_logprobs(model, tr, idx, device)
                rows.append({"engine": eng, "trainer": tr, **mismatch_metrics(mu, pi, mask)})
        mu_common = prefill(llm, common[0], device)
        for tr in trainers_of(eng, args.quick):
            d = mu_common - pis[tr]
            if (eng, tr) == ("bf16", "bf16"):
                base = d
            paired.append(
                {
                    "engine": eng,
                    "trainer": tr,
                    "d": d,
                    **mismatch_metrics(mu_common, pis[tr], common[2]),
                }
            )
        if (
            eng == "bf16" and not args.quick
        ):  # rounds over the modes after a warm-up round, so drift hits every mode alike
            modes = (*ENGINES, "bf16-aligned")  # each side of a fix
            times = [
                [time_fwd_bwd(model, tr, idx[:512], device) for tr in modes] for _ in range(4)
            ][1:]
            cost = {tr: sorted(t[i] for t in times)[1] for i, tr in enumerate(modes)}
    for r in paired:
        r["over_bf16"] = paired_ratio(r.pop("d"), base, common[2])
    matched = {r["engine"]: r for r in rows if r["engine"] == r["trainer"]}
    # k1 is signed (its errors cancel), so a ratio of it means nothing; every other metric is >= 0.
    ratio = {
        k: matched["bf16"][k] / matched["fp16"][k]
        for k in matched["fp16"]
        if k.startswith("mismatch_") and k != "mismatch_k1"
    }
    layers = layer_errors(
        model, ("bf16", "fp16", "bf16-aligned", "fp16-aligned"), common[1], common[2], device
    )
    result = {
        "experiment": "mismatch",
        "checkpoint": ckpt,
        "seed": args.seed,
        "machine": machine(),
        "layers": layers,
        "sequences_per_engine": len(prompts) * args.group_size,
        "tokens_per_engine": int(common[2].sum()),
        "rows": rows,
        "self_rows": self_rows,
        "paired_rows": paired,
        "bf16_over_fp16": ratio,
        "engine_tokens_per_s": speed,
        "trainer_fwd_bwd_s": cost,
    }
    print_mismatch(result)
    return result

def layer_errors(model, modes, idx, mask, device):
    """Where a trainer mode's error enters: its residual stream after each block, the final norm's
    output and the logits against the float32 forward's on the same tokens, as RMS of the
    difference over RMS of the float32 value (response positions). The aligned modes compute
    what the engine computes: the engine's own error, layer by layer."""

    def activations(mode):
        seen = []
        hooks = [
            m.register_forward_hook(lambda m, i, o: seen.append(o.float()))
            for m in (*model.layers, model.norm)
        ]
        with torch.no_grad():
            seen.append(
                (model if mode == "fp32" else precision_of(mode, device).forward(model))(
                    idx[:, :-1]
                ).float()
            )
        [h.remove() for h in hooks]
        return seen

    on, ref = mask.bool(), activations("fp32")
    rms = lambda x: x[on].double().pow(2).mean().sqrt().item()  # noqa: E731
    return {
        mode: [rms(a - r) / rms(r) for a, r in zip(activations(mode), ref)] for mode in modes
    }

def print_mismatch(result):
    keys = [
        "mismatch_k3",
        "mismatch_prob_abs_mean",
        "mismatch_prob_abs_max",
        "mismatch_logp_abs_mean",
        "mismatch_seq_logratio_abs",
    ]
    head = " ".join(f"{k[9:]:>17}" for k in keys)
    print(
        f"\nmismatch between engine (mu) and trainer (pi) on {result['checkpoint']}, "
        f"{result['sequences_per_engine']} responses per engine\n"
        f"{machine_line(result['machine'])}\n\nown samples (what a run sees)\n"
        f"{'engine':12} {'trainer':14} {head}"
    )
    for r in result["rows"]:
        print(f"{r['engine']:12} {r['trainer']:14} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    ratio = result["bf16_over_fp16"]
    print(f"{'bf16 / fp16, matched':27} " + " ".join(f"{ratio[k]:>17.1f}" for k in keys))
    print(
        f"\nthe engine against itself: decode (KV cache) vs prefill of the same tokens\n{'engine':27} {head}"
    )
    for r in result["self_rows"]:
        print(f"{r['engine']:27} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    print(
        f"\npaired: the fp32 engine's {result['tokens_per_engine']} tokens, every engine's "
        "prefill against every trainer; mean |d| over the bf16 row's [95 % bootstrap]\n"
        f"{'engine':12} {'trainer':14} {head} {'over bf16':>24}"
    )
    for r in result["paired_rows"]:
        o = r["over_bf16"]
        print(
            f"{r['engine']:12} {r['trainer']:14} "
            + " ".join(f"{r[k]:>17.3e}" for k in keys)
            + f" {o['ratio']:>7.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]"
        )
    print(
        f"\nwhere the error enters: RMS of (mode - fp32) over RMS of fp32\n{'mode':14} "
        + " ".join(f"{f'block {i}':>9}" for i in range(len(result["layers"]["bf16"]) - 2))
        + f" {'norm':>9} {'logits':>9}"
    )
    for mode, errs in result["layers"].items():
        print(f"{mode:14} " + " ".join(f"{e:>9.2e}" for e in errs))
    speed, cost = result["engine_tokens_per_s"], result["trainer_fwd_bwd_s"]
    if not cost:
        return
    print(
        "\nthe cost (against bf16): engine sampling, tokens/s; trainer forward + backward of 512 sequences, s"
    )
    for eng in (*ENGINES, "bf16-aligned"):
        s = (
            f"engine {speed[eng]:>6.0f} {speed[eng] / speed['bf16']:5.2f}x"
            if eng in speed
            else f"{'':20}"
        )
        print(f"{eng:12} {s} | trainer {cost[eng]:5.2f} {cost[eng] / cost['bf16']:5.2f}x")

def time_fwd_bwd(model, mode, idx, device):  # seconds for one forward + backward
    t0 = time.perf_counter()
    trainer_logprobs(model, mode, idx, device).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0

# ---------------------------------------------------------------------------------------------------
# 2. The GradScaler at work

def flat_grad(model, loss):
    """The gradient of `loss` in the float32 master weights, as one vector."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for p in model.parameters()
        ]
    )

def underflow(g, exact):
    """Of the entries non-zero in float32: the share stored as 0, and as 0 or a subnormal number."""
    n = max(1, (exact != 0).sum().item())
    return (
        ((g == 0) & (exact != 0)).sum().item() / n,
        ((g.abs() < torch.finfo(g.dtype).tiny) & (exact != 0)).sum().item() / n,
    )

def scaler(args, engine=None):
    """One real GRPO batch of the warm start (the fp16 engine's samples and advantages): its policy
    gradient from the 16-bit trainer at several loss scales, against float32's. Unscaled, fp16's
    backward flushes most tiny entries of the logits' gradient (a token mean over ~12,000 tokens) to
    zero or a subnormal; 2**16 keeps more of them, and loses almost none of the weight gradient;
    2**24 overflows to inf."""
    ckpt, model, device, get_engine = setup(args, engine)
    train_batch = task.make_splits(args.seed, args.n_items, task.N_EVAL)[1]
    batch = rollout(get_engine("fp16"), train_batch, rl_args(args), 0, device)
    norm = loss_norm(batch.mask, "grpo", False, args.max_new_tokens)

    def grad(name, scale):
        """(the logits' gradient, still scaled; the weights', unscaled in float32 as unscale_ does)"""
        forward, seen = get_precision(name, device=device).forward(model), {}

        def forward_keeping_logit_grad(x):
            logits = forward(x)
            logits.register_hook(
                lambda g: seen.update(logits=g)
            )  # returns None: g goes on unchanged
            return logits

        logp = token_logprobs(forward_keeping_logit_grad, batch.idx)
        loss = grpo_loss(logp, logp.detach(), batch, norm)[
            0
        ]  # ratio 1: the plain policy gradient
        g = flat_grad(model, loss * scale) / scale  # the backward fills seen["logits"]
        return seen["logits"], g

    exact_logits, exact = grad("fp32", 1.0)
    rows = []
    for name, scale in [
        ("bf16", 1.0),
        ("fp16", 1.0),
        ("fp16", 2.0**8),
        ("fp16", INIT_SCALE),
        ("fp16", 2.0**24),
    ]:
        g_logits, g = grad(name, scale)
        zero, sub = underflow(g_logits, exact_logits)
        finite = bool(torch.isfinite(g).all())
        rows.append(
            {
                "dtype": name,
                "loss_scale": scale,
                "finite": finite,
                "logit_grad_zero": zero,
                "logit_grad_underflow": sub,
                "weight_grad_zero": underflow(g, exact)[0],
                "rel_error": ((g - exact).norm() / exact.norm()).item() if finite else None,
            }
        )
    result = {
        "experiment": "scaler",
        "checkpoint": ckpt,
        "machine": machine(),
        "sequences": len(batch.adv),
        "tokens": int(batch.mask.sum()),
        "rows": rows,
    }
    print(
        f"\nthe policy gradient of one GRPO batch ({len(batch.adv)} sequences, {result['tokens']} tokens) on {ckpt}\n"
        f"{machine_line(result['machine'])}\nagainst float32's; of the entries non-zero there, the share stored as 0 (or as 0"
        f" or a subnormal)\n\n{'trainer':8} {'scale':>9} {'logit grad 0':>13} {'0 or subn.':>11} {'weight grad 0':>14} {'rel. error':>11}"
    )
    for r in rows:
        err = f"{r['rel_error']:>11.2e}" if r["finite"] else f"{'overflow':>11}"
        print(
            f"{r['dtype']:8} {r['loss_scale']:>9.0f} {r['logit_grad_zero']:>13.1%} {r['logit_grad_underflow']:>11.1%} "
            f"{r['weight_grad_zero']:>14.2%} {err}"
        )
    return result

# ---------------------------------------------------------------------------------------------------
# 5. The trainer half alone: where vLLM is not (a GPU machine without it)

CUDA_FLAGS = (
    "allow_tf32",
    "allow_fp16_reduced_precision_reduction",
    "allow_bf16_reduced_precision_reduction",
)  # cuBLAS's settings: what a GPU computes

def trainer(args, engine=None):
    """No engine, no sampling: the held-out problems with their right answers, teacher-forced. Each
    trainer's log-probs of the answers against float32's on the same device, and the gradient of
    their mean against float32's (fp16 unscaled and at INIT_SCALE); on a GPU, each trainer on the
    tensor cores against the same trainer on this machine's CPU, where precision.py emulates them.
    Near 0 there, next to the 16-bit error: the emulation computes what the tensor cores compute.
    --gpu-ablation swaps the GPU's kernels that may differ from the emulation's, one or both."""
    device = get_precision("fp32").device
    cfg = model_config(args.n_items, args.max_new_tokens)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, device)
    problems = task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    prompts = [task.prompt_ids(p) for p, _ in problems]
    answers = [task.answer_ids(a) for _, a in problems]
    if args.gpu_ablation in ("full-reduction", "both"):  # 16-bit GEMMs reduce in float32 alone
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    math_attention = args.gpu_ablation in ("math-attention", "both")
    logp, rows, grads, layers = {}, [], [], {}
    for dev in ("cpu", "cuda") if device == "cuda" else ("cpu",):
        model, (idx, mask, _) = load_hf(ckpt, dev).eval(), pack(prompts, answers, dev)
        on_math = math_attention and dev == "cuda"  # SDPA's plain kernel: matmul, softmax, matmul
        with sdpa_kernel(SDPBackend.MATH) if on_math else nullcontext():
            with torch.no_grad():
                for mode in DTYPES:
                    logp[dev, mode] = trainer_logprobs(model, mode, idx, dev).cpu()
            layers[dev] = layer_errors(model, DTYPES[1:], idx, mask, dev)
            grads += gradient_errors(model, idx, mask, dev)
        mask = mask.cpu()
        for mode in DTYPES[1:]:  # the 16-bit trainer (pi) against float32 (in mu's place)
            rows.append(
                {
                    "device": dev,
                    "trainer": mode,
                    **basic_metrics(logp[dev, "fp32"], logp[dev, mode], mask),
                }
            )
    cross = [  # the CPU's (mu's place) against the GPU's
        {"trainer": mode, **basic_metrics(logp["cpu", mode], logp["cuda", mode], mask)}
        for mode in DTYPES
    ] if device == "cuda" else []
    flags = {f: getattr(torch.backends.cuda.matmul, f) for f in CUDA_FLAGS}
    result = {
        "experiment": "trainer",
        "checkpoint": ckpt,
        "machine": machine(),
        "problems": len(problems),
        "tokens": int(mask.sum()),
        "cuda_matmul": flags,
        "gpu_ablation": args.gpu_ablation,
        "rows": rows,
        "cross_rows": cross,
        "layers": layers,
        "grads": grads,
    }
    print_trainer(result)
    return result

def gradient_errors(model, idx, mask, dev):
    """The gradient of the answers' mean log-prob (the SFT's) from each 16-bit trainer against
    float32's: its relative error, and the share of entries non-zero there that it stores as 0."""
    def mean_logp(mode):
        return (trainer_logprobs(model, mode, idx, dev) * mask).sum() / mask.sum()

    exact, rows = flat_grad(model, mean_logp("fp32")), []
    for mode, scale in [("bf16", 1.0), ("fp16", 1.0), ("fp16", INIT_SCALE)]:
        g = flat_grad(model, mean_logp(mode) * scale) / scale
        rows.append(
            {
                "device": dev,
                "trainer": mode,
                "loss_scale": scale,
                "weight_grad_zero": underflow(g, exact)[0],
                "rel_error": ((g - exact).norm() / exact.norm()).item(),
            }
        )
    return rows

def print_trainer(result):
    keys = [
        "mismatch_k3",
        "mismatch_logp_abs_mean",
        "mismatch_prob_abs_max",
        "mismatch_seq_logratio_abs",
    ]
    head = " ".join(f"{k[9:]:>17}" for k in keys)
    print(
        f"\nthe trainer half on {result['checkpoint']}: {result['problems']} held-out problems' "
        f"answers, {result['tokens']} tokens, --gpu-ablation {result['gpu_ablation']}\n"
        f"{machine_line(result['machine'])}\n"
        f"\neach 16-bit trainer against float32 on the same device\n{'device':7} {'trainer':8} {head}"
    )
    for r in result["rows"]:
        print(f"{r['device']:7} {r['trainer']:8} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    if result["cross_rows"]:
        print(
            f"\nthe GPU against the CPU, same trainer (cuBLAS {result['cuda_matmul']})\n{'':7} "
            f"{'trainer':8} {head}"
        )
    for r in result["cross_rows"]:
        print(f"{'':7} {r['trainer']:8} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    print(
        f"\nwhere the error enters: RMS of (mode - fp32) over RMS of fp32, block by block, norm, logits"
    )
    for dev, modes in result["layers"].items():
        for mode, errs in modes.items():
            print(f"{dev:7} {mode:8} " + " ".join(f"{e:>9.2e}" for e in errs))
    print(
        f"\nthe gradient of the answers' mean log-prob against float32's\n"
        f"{'device':7} {'trainer':8} {'scale':>9} {'weight grad 0':>14} {'rel. error':>11}"
    )
    for g in result["grads"]:
        print(
            f"{g['device']:7} {g['trainer']:8} {g['loss_scale']:>9.0f} "
            f"{g['weight_grad_zero']:>14.2%} {g['rel_error']:>11.2e}"
        )

# ---------------------------------------------------------------------------------------------------
# The statistics plot.py shares

T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
)  # Student's t, dof 1 to 10

def t_quantile(dof, z=1.959964):
    """Student's t 0.975 quantile: the table to 10 degrees of freedom, then Cornish-Fisher (within 0.003)."""
    return (
        T975[dof - 1]
        if dof <= 10
        else z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)
    )

def fmt(x, spec=".1e"):
    return "-" if x is None else format(x, spec)

# ---------------------------------------------------------------------------------------------------
# 3. The gradient-bias audit

def audit_losses(logp, pi_logp, mu_logp, adv, mask, n_tokens):
    """On samples from mu: GRPO's J = sum_i A_i sum_t log pi(y_it) / N_tokens and the mismatch's part,
    J_bias = sum_i (1 - w_i) A_i sum_t log pi(y_it) / N_tokens, w_i = prod_t pi / mu (detached): grad J -
    grad J_bias is unbiased for pi, so d = grad J_bias is the bias. Returns (J, J_bias, w)."""
    w = torch.exp(((pi_logp - mu_logp) * mask).sum(1)).detach()
    per_seq = (logp * mask).sum(1)
    return (adv * per_seq).sum() / n_tokens, ((1 - w) * adv * per_seq).sum() / n_tokens, w

def bias_statistics(G_dd, G_gg, G_dg):
    """From the K x K Gram matrices of the per-batch bias vectors d_k and gradients g_k (G_dg[j, k] =
    d_j . g_k), each statistic as an unbiased pairwise estimate over distinct batches (so no batch's
    noise is counted against itself):
      b2        |E d|^2 = mean over j != k of d_j . d_k    (may come out < 0: then |b| is not resolved)
      eg2       |E g|^2, the same for g
      sigma2    tr Cov g, one step's noise in all directions
      b_dot_eg  E d . E g = mean over j != k of d_j . g_k  (d and g of one batch share its noise)
      noise_along_b  Var_k(g_k . b_hat_k), b_hat_k the direction of the other batches' summed d: the
                     noise along the bias, each batch against a direction it did not help estimate.
    """
    K = G_dd.shape[0]
    off = ~torch.eye(K, dtype=torch.bool)
    pair = lambda G: G[off].mean().item()  # noqa: E731
    sigma2 = (G_gg.trace() - G_gg.sum() / K).item() / (K - 1)
    along = []
    for k in range(K):
        others = torch.arange(K) != k
        along.append((G_dg[others, k].sum() / G_dd[others][:, others].sum().sqrt()).item())
    return {
        "b2": pair(G_dd),
        "eg2": pair(G_gg),
        "sigma2": sigma2,
        "b_dot_eg": pair(G_dg),
        "noise_along_b": float(np.var(along, ddof=1)),
    }

def derived(s):
    """|b|, |b| / sigma, cos(b, E g), and the steps after which a bias that kept its direction would
    match the summed noise: (sigma / |b|)^2 against all ~0.9M directions' noise (an upper bound),
    noise_along_b / |b|^2 against the noise along the bias alone."""
    b = math.sqrt(s["b2"]) if s["b2"] > 0 else 0.0
    return {
        "bias_norm": b,
        "bias_over_noise": b / math.sqrt(s["sigma2"]),
        "grad_mean_norm": math.sqrt(max(s["eg2"], 0)),
        "cos_bias_grad": (
            s["b_dot_eg"] / (b * math.sqrt(s["eg2"])) if b and s["eg2"] > 0 else None
        ),
        "steps_upper": s["sigma2"] / s["b2"] if s["b2"] > 0 else None,
        "steps_along": s["noise_along_b"] / s["b2"] if s["b2"] > 0 else None,
    }

def jackknife(G_dd, G_gg, G_dg):
    """Every statistic and figure with its own 95 % jackknife interval: the figure itself recomputed
    with each batch left out, t quantile with K - 1 dof; none where a leave-one-out leaves it undefined
    (|b|^2 <= 0). A bias is resolved when the interval of |b|^2 excludes 0."""
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
    """For each dtype (engine and trainer in it), --batches independent batches of the engine's samples
    (the RL run's first --batches rollouts, at fixed weights): g (GRPO's gradient) and d (its bias,
    audit_losses) per batch, through the float32 forward at the same weights, so d holds the mismatch
    alone (where the samples came from, and how pi weighs them), not the 16-bit backward's rounding
    (`scaler` measures that). The K vectors of each kind are kept; their Gram matrices give every figure
    and its interval (bias_statistics, jackknife). With --dial-doses: instead of the dtypes, the bf16
    trainer on the engine's kernels (no mismatch of its own) against a bf16 engine perturbed by the
    mismatch dial (dial.py) at each dose: the audit's prediction for the dial's RL runs."""
    ckpt, model, device, get_engine = setup(args, engine)
    train_batch = task.make_splits(args.seed, args.n_items, task.N_EVAL)[1]
    rows = []
    if not args.dial_doses:
        for name in DTYPES:
            prec, llm = get_precision(name, device=device), get_engine(name)
            rows.append({"dtype": name, **audit_row(model, prec, llm, train_batch, args, device)})
    else:
        import dial

        calibration = json.load(open(args.dial_calibration))
        cfg = model_config(args.n_items, args.max_new_tokens)
        llm = start_engine(ckpt, "bfloat16", args.seed, cfg.max_seq_len, **dial.engine_args(1.0))
        aligned = get_precision("bf16", device=device, kernels="engine")
        for dose in args.dial_doses:
            sigma = dial.sigma_for(calibration, args.dial_shape, dose)
            dial.configure(sigma, args.dial_shape, calibration["profile"])
            row = audit_row(model, aligned, llm, train_batch, args, device)
            rows.append({"dtype": f"dial{dose}", "dial_dose": dose, "dial_shape": args.dial_shape,
                         "dial_sigma": sigma, "dial_unit": calibration["unit"], **row})
        dial.configure(0.0)
    result = {
        "experiment": "audit",
        "checkpoint": ckpt,
        "machine": machine(),
        "max_new_tokens": args.max_new_tokens,
        "sequences_per_batch": args.batch_size * args.group_size,
        "rows": rows,
    }
    print_audit(result)
    return result

def audit_row(model, prec, llm, train_batch, args, device):
    """One mode's figures over --batches batches (the same prompts and random numbers for every mode)."""
    params = list(model.parameters())
    gs, ds, k3, dev = [], [], [], []
    for k in range(args.batches):
        b = rollout(llm, train_batch, rl_args(args), k, device)
        with torch.no_grad():
            pi = token_logprobs(prec.forward(model), b.idx)  # the trainer's pi, in the run's dtype
        J, J_bias, w = audit_losses(
            token_logprobs(model, b.idx), pi, b.mu_logp, b.adv, b.mask, b.mask.sum()
        )
        grad = torch.autograd.grad(J, params, retain_graph=True)
        gs.append(torch.cat([x.flatten() for x in grad]).double())
        ds.append(torch.cat([x.flatten() for x in torch.autograd.grad(J_bias, params)]).double())
        dev.append((w - 1).abs().mean().item())
        metrics = mismatch_metrics(b.mu_logp, pi, b.mask)
        k3.append((metrics["mismatch_k3"], metrics["mismatch_logp_abs_mean"]))
    # float64 Gram matrices: the pairwise products are small differences
    G, D = torch.stack(gs), torch.stack(ds)
    stats = jackknife(D @ D.T, G @ G.T, D @ G.T)
    return {
        "batches": args.batches,
        **stats,
        "seq_weight_abs_dev": sum(dev) / len(dev),
        "mismatch_k3": sum(x for x, _ in k3) / len(k3),
        "mismatch_logp_abs_mean": sum(y for _, y in k3) / len(k3),
    }

def print_audit(result):
    print(
        f"\ngradient-bias audit on {result['checkpoint']}: {result['rows'][0]['batches']} batches x "
        f"{result['sequences_per_batch']} sequences per dtype\n{machine_line(result['machine'])}\n95 % jackknife "
        f"intervals over batches, each figure's own; a bias is resolved when the interval of |b|^2 excludes 0\n"
    )
    ci = lambda r, k: (
        f"[{fmt(r[k + '_ci'][0])}, {fmt(r[k + '_ci'][1])}]" if k + "_ci" in r else "-"
    )  # noqa: E731
    print(
        f"{'dtype':5} {'|b|':>7} {'[95% CI]':>19} {'sigma':>6} {'|b|/sigma':>9} {'[95% CI]':>19} {'cos(b,Eg)':>9} "
        f"{'steps (upper)':>13} {'[95% CI]':>19} {'steps (along b)':>15} {'[95% CI]':>19} {'|log mu-log pi|':>15}"
    )
    for r in result["rows"]:
        print(
            f"{r['dtype']:5} {r['bias_norm']:>7.1e} {ci(r, 'bias_norm'):>19} {math.sqrt(r['sigma2']):>6.3f} "
            f"{r['bias_over_noise']:>9.1e} {ci(r, 'bias_over_noise'):>19} {fmt(r['cos_bias_grad'], '+.2f'):>9} "
            f"{fmt(r['steps_upper']):>13} {ci(r, 'steps_upper'):>19} {fmt(r['steps_along']):>15} "
            f"{ci(r, 'steps_along'):>19} {r['mismatch_logp_abs_mean']:>15.2e}"
        )

# ---------------------------------------------------------------------------------------------------
# 4. Held-out accuracy, read the same way for every run

def heldout(args, engine=None):
    """A policy's held-out accuracy read by one fp32 engine whatever dtype trained it (each run's own
    engine reads identical weights differently), --samples of every problem at temperature 1, the same
    random numbers for every policy of a seed (paired); the s.e. is over problems (ddof 1)."""
    ckpt, model, device, get_engine = setup(args, engine)
    problems = task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    torch.manual_seed(task.seed_of("heldout", args.seed))
    samples = generate(
        get_engine("fp32"),
        [task.prompt_ids(p) for p, _ in problems],
        args.samples,
        args.max_new_tokens,
        task.EOS_ID,
    )
    right = np.array(
        [
            task.reward(s.response_ids, a)
            for s, (_, a) in zip(samples, [p for p in problems for _ in range(args.samples)])
        ]
    )
    per_problem = right.reshape(len(problems), args.samples).mean(1)
    result = {
        "experiment": "heldout",
        "checkpoint": ckpt,
        "machine": machine(),
        "problems": len(problems),
        "samples_per_problem": args.samples,
        "accuracy": float(per_problem.mean()),
        "se": float(per_problem.std(ddof=1) / math.sqrt(len(problems))),
    }
    print(
        f"held-out accuracy of {ckpt} (fp32 engine, {len(problems)} problems x {args.samples}): "
        f"{result['accuracy']:.4f} +- {result['se']:.4f}"
    )
    return result

# ---------------------------------------------------------------------------------------------------

def at_least(low):
    """An argparse type: an int >= low."""

    def parse(text):
        if int(text) < low:  # a ValueError becomes argparse's "invalid value"
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return int(text)

    return parse

def rl_args(args):
    """The flags train_grpo.rollout reads, its seed --rl-seed: a run's batches, step by step."""
    return argparse.Namespace(**{**vars(args), "seed": args.rl_seed})

def get_args(argv=None):
    p = argparse.ArgumentParser(
        description="the offline experiments: mismatch, scaler, audit, heldout, trainer",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line, exit 2
    p.add_argument(
        "experiment",
        choices=["mismatch", "scaler", "audit", "heldout", "trainer"],
        help="which experiment (the docstring)",
    )
    p.add_argument(
        "--init",
        default=None,
        help="the weights: a checkpoint folder (default: the warm start)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the task's splits and warm start, and the engine's sampling",
    )
    p.add_argument(
        "--rl-seed",
        type=int,
        default=0,
        help="scaler, audit: the batches' prompts and sampling",
    )
    p.add_argument(
        "--n-items",
        type=at_least(1),
        default=12,
        help="digits to sort: the response is 2*n tokens",
    )
    p.add_argument("--group-size", type=at_least(2), default=8, help="samples per prompt")
    p.add_argument(
        "--batch-size", type=at_least(1), default=64, help="scaler, audit: prompts per batch"
    )
    p.add_argument(
        "--batches",
        type=at_least(5),
        default=20,
        help="audit: independent batches (K) per dtype, >= 5",
    )
    p.add_argument("--dial-doses", type=int, nargs="+", default=None,
                   help="audit: the mismatch dial's doses (dial.py), instead of the dtypes")
    p.add_argument("--dial-shape", default="uniform", choices=["uniform", "bf16"])
    p.add_argument("--dial-calibration", default=None, help="audit --dial-doses: dial.py's JSON")
    p.add_argument(
        "--samples",
        type=at_least(1),
        default=8,
        help="heldout: samples of each held-out problem",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="mismatch: fp32, bf16, fp16 only, no costs (a trained policy)",
    )
    p.add_argument(
        "--gpu-ablation",
        choices=["none", "full-reduction", "math-attention", "both"],
        default="none",
        help="trainer, on a GPU: cuBLAS's 16-bit reductions off, and/or attention on SDPA's math kernel",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.gpu_ablation != "none" and not (args.experiment == "trainer" and torch.cuda.is_available()):
        p.error("--gpu-ablation: the trainer experiment, on a GPU (none here)")
    args.max_new_tokens, args.dr_grpo = 2 * args.n_items + 8, False
    try:
        read_config(args.init) if args.init else None
    except ValueError as e:
        p.error(f"--init: {e}")
    if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)) or ".", os.W_OK):
        p.error(f"--json {args.json}: its folder does not exist or cannot be written")
    if args.dial_doses and not (args.dial_calibration and os.path.isfile(args.dial_calibration)):
        p.error("--dial-doses needs --dial-calibration FILE (experiments/dial.py calibrate)")
    return args

def main(argv=None, engine=None):
    args = get_args(argv)
    experiments = dict(mismatch=mismatch, scaler=scaler, audit=audit, heldout=heldout, trainer=trainer)
    result = experiments[args.experiment](args, engine)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1))
        print(f"\nwritten to {args.json}")
    return result

if __name__ == "__main__":
    main()
