"""
experiments/probe.py: the offline experiments. No training: fixed weights (the warm start, or --init
DIR, e.g. a finished run's hf/), the real engine in each dtype, the trainer beside it.

    python experiments/probe.py mismatch --json runs/probe.json  # the paper's offline test, every fix's rows and cost
    python experiments/probe.py scaler   --json runs/scaler.json # why an fp16 trainer needs the GradScaler
    python experiments/probe.py heldout  --init DIR --json F     # a policy's held-out accuracy, read by one fp32 engine
Every result records the machine: the 16-bit numbers are the chip's."""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from the repository root
import task  # noqa: E402
import train_grpo as tg  # noqa: E402
from model import hf_named_tensors, load_hf, token_logprobs  # noqa: E402
from precision import INIT_SCALE, get_precision, machine, machine_line, mismatch_metrics  # noqa: E402
from rollout import generate, prefill_logprobs, start_engine, sync_weights  # noqa: E402

# Each side's way of computing: a dtype, "+head32" for the fp32 LM head (--lm-head fp32), "-aligned" for the
# trainer on the engine's kernels (--trainer-kernels engine).
ENGINES = ("fp32", "bf16", "fp16", "bf16+head32", "fp16+head32")
DTYPES = ("fp32", "bf16", "fp16")
RESAMPLES = 2000  # bootstrap resamples of the sequences, for the paired ratios' intervals

def precision_of(mode, device):
    return get_precision(mode.split("+")[0].split("-")[0], lm_head="fp32" if "+head32" in mode else "same", device=device,
                         kernels="engine" if mode.endswith("aligned") else "torch")

def trainers_of(eng, quick=False):  # a dtype's engine: the plain trainers and its aligned one; a fix's engine: its trainer, and fp32
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
    cfg = tg.model_config(args.n_items, args.max_new_tokens)
    ckpt = args.init or tg.warm_start(cfg, args.n_items, args.seed, device)
    model, engines = load_hf(ckpt, device).eval(), {}

    def get_engine(mode):
        prec = precision_of(mode, device)
        if mode not in engines:
            engines[mode] = engine(prec.vllm_dtype, prec.head_fp32) if engine else start_engine(
                ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32)
        sync_weights(engines[mode], hf_named_tensors(model), prec.engine_dtype)
        return engines[mode]
    return ckpt, model, device, get_engine

def sample(llm, prompts, n, args, device):  # -> samples, idx, mask, mu, seconds
    torch.manual_seed(task.seed_of("probe", args.seed))  # the global generator: the same numbers per engine
    t0 = time.perf_counter()
    samples = generate(llm, prompts, n, args.max_new_tokens, task.EOS_ID)
    seconds = time.perf_counter() - t0
    idx, mask, mu = tg.pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device,
                            [s.logprobs for s in samples])
    return samples, idx, mask, mu, seconds

def prefill(llm, samples, device):
    """The engine's prefill log-probs of the samples' response tokens, laid out as pack lays out mu."""
    lps = prefill_logprobs(llm, [s.prompt_ids + s.response_ids for s in samples], [len(s.prompt_ids) for s in samples])
    return tg.pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], device, lps)[2]

# ---------------------------------------------------------------------------------------------------
# 1. The mismatch, and what each fix costs

def paired_ratio(d_a, d_b, mask, seed=0):
    """mean |d_a| / mean |d_b| over the same tokens, with a 95 % percentile bootstrap interval that
    resamples whole sequences (tokens of one sequence are not independent), both rows together."""
    a, b, n = ((d_a.abs() * mask).sum(1).double().numpy(), (d_b.abs() * mask).sum(1).double().numpy(),
               mask.sum(1).double().numpy())
    pick = np.random.default_rng(seed).integers(0, len(n), size=(RESAMPLES, len(n)))
    boot = a[pick].sum(1) / b[pick].sum(1)
    return {"ratio": float(a.sum() / b.sum()), "ci95": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]}

def mismatch(args, engine=None):
    """On the held-out prompts, --group-size samples each, three tables. own: each engine samples (timed the
    second time, after a warm-up) and each trainer mode scores: what a run sees. self: each engine's decode
    log-probs of its samples against its prefill of them. paired: the fp32 engine's samples scored by every
    engine's prefill and every trainer, each row over the bf16 row on the same tokens, with a 95 % bootstrap
    interval. Then each trainer mode's forward + backward of 512 sequences, timed, and where in the network each 16-bit
    trainer's error enters (layer_errors). --quick (a trained policy's cross-probe): the three dtypes, matched and
    aligned trainers, no costs."""
    ckpt, model, device, get_engine = setup(args, engine)
    prompts = [task.prompt_ids(p) for p, _ in task.make_splits(args.seed, args.n_items, tg.N_EVAL)[0]]  # held out
    rows, self_rows, paired, speed, cost = [], [], [], {}, {}
    common = sample(get_engine("fp32"), prompts, args.group_size, args, device)
    engines = DTYPES if args.quick else ENGINES
    with torch.no_grad():
        pis = {tr: trainer_logprobs(model, tr, common[1], device) for eng in engines for tr in trainers_of(eng, args.quick)}
    base = None
    for eng in engines:
        llm = get_engine(eng)
        sample(llm, prompts, args.group_size, args, device)
        samples, idx, mask, mu, seconds = sample(llm, prompts, args.group_size, args, device)
        speed[eng] = mask.sum().item() / seconds
        self_rows.append({"engine": eng, **mismatch_metrics(mu, prefill(llm, samples, device), mask)})
        with torch.no_grad():
            for tr in trainers_of(eng, args.quick):
                pi = trainer_logprobs(model, tr, idx, device)
                rows.append({"engine": eng, "trainer": tr, **mismatch_metrics(mu, pi, mask)})
        mu_common = prefill(llm, common[0], device)
        for tr in trainers_of(eng, args.quick):
            d = mu_common - pis[tr]
            if (eng, tr) == ("bf16", "bf16"):
                base = d
            paired.append({"engine": eng, "trainer": tr, "d": d, **mismatch_metrics(mu_common, pis[tr], common[2])})
        if eng == "bf16" and not args.quick:  # rounds over the modes after a warm-up round, so drift hits every mode alike
            modes = (*ENGINES, "bf16-aligned")  # each side of a fix
            times = [[time_fwd_bwd(model, tr, idx[:512], device) for tr in modes] for _ in range(4)][1:]
            cost = {tr: sorted(t[i] for t in times)[1] for i, tr in enumerate(modes)}
    for r in paired:
        r["over_bf16"] = paired_ratio(r.pop("d"), base, common[2])
    matched = {r["engine"]: r for r in rows if r["engine"] == r["trainer"]}
    # k1 is signed (its errors cancel), so a ratio of it means nothing; every other metric is >= 0.
    ratio = {k: matched["bf16"][k] / matched["fp16"][k] for k in matched["fp16"]
             if k.startswith("mismatch_") and k != "mismatch_k1"}
    layers = layer_errors(model, ("bf16", "fp16", "bf16-aligned", "fp16-aligned"), common[1], common[2], device)
    result = {"experiment": "mismatch", "checkpoint": ckpt, "seed": args.seed, "machine": machine(), "layers": layers,
              "sequences_per_engine": len(prompts) * args.group_size, "tokens_per_engine": int(common[2].sum()),
              "rows": rows, "self_rows": self_rows, "paired_rows": paired, "bf16_over_fp16": ratio,
              "engine_tokens_per_s": speed, "trainer_fwd_bwd_s": cost}
    print_mismatch(result)
    return result

def layer_errors(model, modes, idx, mask, device):
    """Where a trainer mode's error enters: its residual stream after each block, the final norm's output and the logits
    against the float32 forward's on the same tokens, as RMS of the difference over RMS of the float32 value (response
    positions). The aligned modes compute what the engine computes: the engine's own error, layer by layer."""
    def activations(mode):
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.float())) for m in (*model.layers, model.norm)]
        with torch.no_grad():
            seen.append((model if mode == "fp32" else precision_of(mode, device).forward(model))(idx[:, :-1]).float())
        [h.remove() for h in hooks]
        return seen
    on, ref = mask.bool(), activations("fp32")
    rms = lambda x: x[on].double().pow(2).mean().sqrt().item()  # noqa: E731
    return {mode: [rms(a - r) / rms(r) for a, r in zip(activations(mode), ref)] for mode in modes}

def print_mismatch(result):
    keys = ["mismatch_k3", "mismatch_prob_abs_mean", "mismatch_prob_abs_max", "mismatch_logp_abs_mean", "mismatch_seq_logratio_abs"]
    head = " ".join(f"{k[9:]:>17}" for k in keys)
    print(f"\nmismatch between engine (mu) and trainer (pi) on {result['checkpoint']}, {result['sequences_per_engine']} "
          f"responses per engine\n{machine_line(result['machine'])}\n\nown samples (what a run sees)\n{'engine':12} {'trainer':14} {head}")
    for r in result["rows"]:
        print(f"{r['engine']:12} {r['trainer']:14} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    ratio = result["bf16_over_fp16"]
    print(f"{'bf16 / fp16, matched':27} " + " ".join(f"{ratio[k]:>17.1f}" for k in keys))
    print(f"\nthe engine against itself: decode (KV cache) vs prefill of the same tokens\n{'engine':27} {head}")
    for r in result["self_rows"]:
        print(f"{r['engine']:27} " + " ".join(f"{r[k]:>17.3e}" for k in keys))
    print(f"\npaired: the fp32 engine's {result['tokens_per_engine']} tokens, every engine's prefill against every trainer;"
          f" mean |d| over the bf16 row's [95 % bootstrap]\n{'engine':12} {'trainer':14} {head} {'over bf16':>24}")
    for r in result["paired_rows"]:
        o = r["over_bf16"]
        print(f"{r['engine']:12} {r['trainer']:14} " + " ".join(f"{r[k]:>17.3e}" for k in keys)
              + f" {o['ratio']:>7.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]")
    print(f"\nwhere the error enters: RMS of (mode - fp32) over RMS of fp32\n{'mode':14} "
          + " ".join(f"{f'block {i}':>9}" for i in range(len(result['layers']['bf16']) - 2)) + f" {'norm':>9} {'logits':>9}")
    for mode, errs in result["layers"].items():
        print(f"{mode:14} " + " ".join(f"{e:>9.2e}" for e in errs))
    speed, cost = result["engine_tokens_per_s"], result["trainer_fwd_bwd_s"]
    if not cost:
        return
    print("\nthe cost (against bf16): engine sampling, tokens/s; trainer forward + backward of 512 sequences, s")
    for eng in (*ENGINES, "bf16-aligned"):
        s = f"engine {speed[eng]:>6.0f} {speed[eng] / speed['bf16']:5.2f}x" if eng in speed else f"{'':20}"
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
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])

def scaler(args, engine=None):
    """One real GRPO batch of the warm start (the fp16 engine's samples and advantages): its policy
    gradient from the 16-bit trainer at several loss scales, against float32's. Unscaled, fp16's
    backward flushes most tiny entries of the logits' gradient (a token mean over ~12,000 tokens) to
    zero or a subnormal; 2**16 keeps more of them, and loses almost none of the weight gradient;
    2**24 overflows to inf."""
    ckpt, model, device, get_engine = setup(args, engine)
    train_batch = task.make_splits(args.seed, args.n_items, tg.N_EVAL)[1]
    batch = tg.rollout(get_engine("fp16"), train_batch, args, 0, device)
    norm = tg.loss_norm(batch.mask, "grpo", False, args.max_new_tokens)

    def grad(name, scale):
        """(the logits' gradient, still scaled; the weights', unscaled in float32 as unscale_ does)"""
        forward, seen = get_precision(name, device=device).forward(model), {}

        def forward_keeping_logit_grad(x):
            logits = forward(x)
            logits.register_hook(lambda g: seen.update(logits=g))  # returns None: g goes on unchanged
            return logits
        logp = token_logprobs(forward_keeping_logit_grad, batch.idx)
        loss = tg.grpo_loss(logp, logp.detach(), batch, norm)[0]  # ratio 1: the plain policy gradient
        g = flat_grad(model, loss * scale) / scale  # the backward fills seen["logits"]
        return seen["logits"], g

    def underflow(g, exact):
        """Of the entries non-zero in float32: the share stored as 0, and as 0 or a subnormal number."""
        n = max(1, (exact != 0).sum().item())
        return (((g == 0) & (exact != 0)).sum().item() / n, ((g.abs() < torch.finfo(g.dtype).tiny) & (exact != 0)).sum().item() / n)

    exact_logits, exact = grad("fp32", 1.0)
    rows = []
    for name, scale in [("bf16", 1.0), ("fp16", 1.0), ("fp16", 2.0 ** 8), ("fp16", INIT_SCALE), ("fp16", 2.0 ** 24)]:
        g_logits, g = grad(name, scale)
        zero, sub = underflow(g_logits, exact_logits)
        finite = bool(torch.isfinite(g).all())
        rows.append({"dtype": name, "loss_scale": scale, "finite": finite, "logit_grad_zero": zero, "logit_grad_underflow": sub,
                     "weight_grad_zero": underflow(g, exact)[0], "rel_error": ((g - exact).norm() / exact.norm()).item() if finite else None})
    result = {"experiment": "scaler", "checkpoint": ckpt, "machine": machine(), "sequences": len(batch.adv),
              "tokens": int(batch.mask.sum()), "rows": rows}
    print(f"\nthe policy gradient of one GRPO batch ({len(batch.adv)} sequences, {result['tokens']} tokens) on {ckpt}\n"
          f"{machine_line(result['machine'])}\nagainst float32's; of the entries non-zero there, the share stored as 0 (or as 0"
          f" or a subnormal)\n\n{'trainer':8} {'scale':>9} {'logit grad 0':>13} {'0 or subn.':>11} {'weight grad 0':>14} {'rel. error':>11}")
    for r in rows:
        err = f"{r['rel_error']:>11.2e}" if r["finite"] else f"{'overflow':>11}"
        print(f"{r['dtype']:8} {r['loss_scale']:>9.0f} {r['logit_grad_zero']:>13.1%} {r['logit_grad_underflow']:>11.1%} "
              f"{r['weight_grad_zero']:>14.2%} {err}")
    return result

# ---------------------------------------------------------------------------------------------------
# 3. Held-out accuracy, read the same way for every run, and the statistics plot.py shares

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)  # Student's t, dof 1 to 10

def t_quantile(dof, z=1.959964):
    """Student's t 0.975 quantile: the table to 10 degrees of freedom, then Cornish-Fisher (within 0.003)."""
    return T975[dof - 1] if dof <= 10 else z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)

def fmt(x, spec=".1e"):
    return "-" if x is None else format(x, spec)

def heldout(args, engine=None):
    """A policy's held-out accuracy read by one fp32 engine whatever dtype trained it (each run's own
    engine reads identical weights differently), --samples of every problem at temperature 1, the same
    random numbers for every policy of a seed (paired); the s.e. is over problems (ddof 1)."""
    ckpt, model, device, get_engine = setup(args, engine)
    problems = task.make_splits(args.seed, args.n_items, tg.N_EVAL)[0]
    torch.manual_seed(task.seed_of("heldout", args.seed))
    samples = generate(get_engine("fp32"), [task.prompt_ids(p) for p, _ in problems], args.samples, args.max_new_tokens, task.EOS_ID)
    right = np.array([task.reward(s.response_ids, a) for s, (_, a) in zip(samples, [p for p in problems for _ in range(args.samples)])])
    per_problem = right.reshape(len(problems), args.samples).mean(1)
    result = {"experiment": "heldout", "checkpoint": ckpt, "machine": machine(), "problems": len(problems), "samples_per_problem":
              args.samples, "accuracy": float(per_problem.mean()), "se": float(per_problem.std(ddof=1) / math.sqrt(len(problems)))}
    print(f"held-out accuracy of {ckpt} (fp32 engine, {len(problems)} problems x {args.samples}): "
          f"{result['accuracy']:.4f} +- {result['se']:.4f}")
    return result

# ---------------------------------------------------------------------------------------------------

def get_args(argv=None):
    p = argparse.ArgumentParser(description="the offline experiments: mismatch, scaler, heldout",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = lambda message: p.exit(2, f"error: {message}\n")  # one line, exit 2
    p.add_argument("experiment", choices=["mismatch", "scaler", "heldout"], help="which experiment (the docstring)")
    p.add_argument("--init", default=None, help="the weights: a checkpoint folder (default: the warm start)")
    p.add_argument("--seed", type=int, default=0, help="the task's splits and warm start, and the engine's sampling")
    p.add_argument("--rl-seed", type=int, default=0, help="scaler: its batch's prompts and sampling")
    p.add_argument("--n-items", type=tg.bounded(int, 1), default=12, help="digits to sort: the response is 2*n tokens")
    p.add_argument("--group-size", type=tg.bounded(int, 2), default=8, help="samples per prompt")
    p.add_argument("--batch-size", type=tg.bounded(int, 1), default=64, help="scaler: prompts in its batch")
    p.add_argument("--samples", type=tg.bounded(int, 1), default=8, help="heldout: samples of each held-out problem")
    p.add_argument("--quick", action="store_true", help="mismatch: fp32, bf16, fp16 only, no costs (a trained policy)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    args.max_new_tokens, args.dr_grpo = 2 * args.n_items + 8, False
    try:
        load_hf(args.init) if args.init else None
    except ValueError as e:
        p.error(f"--init: {e}")
    if args.json and not os.access(os.path.dirname(os.path.abspath(args.json)) or ".", os.W_OK):
        p.error(f"--json {args.json}: its folder does not exist or cannot be written")
    return args

def main(argv=None, engine=None):
    args = get_args(argv)
    result = {"mismatch": mismatch, "scaler": scaler, "heldout": heldout}[args.experiment](args, engine)
    if args.json:
        tg.write_atomic(args.json, json.dumps(result, indent=1))
        print(f"\nwritten to {args.json}")
    return result

if __name__ == "__main__":
    main()
