"""
experiments/trainer_half.py: the trainer half alone, where vLLM is not (a GPU machine
without it): no engine, no sampling.

    python experiments/trainer_half.py --json F                      # CPU; on a GPU: both
    python experiments/trainer_half.py --gpu-ablation both --json F  # a GPU's kernels swapped
    python experiments/trainer_half.py --by-part --json F            # the gradient's error by part
    python experiments/trainer_half.py --sites --json F              # how it rounds at the sites
    python experiments/trainer_half.py --by-part --embed32 --json F  # the CPU's embedding fixed

The held-out problems with their right answers, teacher-forced. Each trainer's log-probs of
the answers against float32's on the same device, and the gradient of their mean against
float32's (fp16 unscaled and at INIT_SCALE); on a GPU, each trainer on the tensor cores
against the same trainer on this machine's CPU, where precision.py emulates them. Near 0
there, next to the 16-bit error: the emulation computes what the tensor cores compute.
--gpu-ablation swaps the GPU's kernels that may differ from the emulation's, one or both;
--by-part splits each gradient's error by part of the model (where the emulation's backward
parts from the GPU's: experiments/chips-gpu.md); --embed32 runs the CPU's 16-bit trainer with
its embedding's backward summed in float32, as a GPU's (embed32.py). --sites: rounding.py's
op probe for this device's trainer at the two sites where vLLM's CPU kernels truncate: the
rotary (model.apply_rope) and each of SDPA's attention kernels, bf16 and fp16, against the
float32 result rounded to nearest and by truncation.
No figure: the tables, and results/<GPU machine>/trainer*.json (experiments/chips.md).
"""
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
import embed32
import task
from common import machine_line
from instruments import machine
from model import GPTConfig, apply_rope, load_hf, pack, rope_cos_sin
from offline import (DTYPES, base_parser, flat_grad, layer_errors, parse,
                     trainer_logprobs, underflow)
from precision import INIT_SCALE, TensorCoreMatmuls, get_precision
from precision import mismatch_metrics as basic_metrics
from rounding import D, H, T, compare, print_rows
from warm_start import model_config, warm_start

CUDA_FLAGS = ("allow_tf32", "allow_fp16_reduced_precision_reduction",
              "allow_bf16_reduced_precision_reduction")  # cuBLAS's: what a GPU computes
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
PARTS = ("embed_tokens", "self_attn", "mlp", "lm_head")  # --by-part; the rest: "norms"
BATCH = 16  # sequences of the op probe's shapes (rounding.py): 131,072 outputs a row
KEYS = ["mismatch_k3", "mismatch_logp_abs_mean", "mismatch_prob_abs_max",
        "mismatch_seq_logratio_abs"]

def trainer(args, engine=None):
    """The tables of the module docstring; `engine` is never used (there is none)."""
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
            grads += gradient_errors(model, idx, mask, dev, args.by_part)
        mask = mask.cpu()
        for mode in DTYPES[1:]:  # the 16-bit trainer (pi) against float32 (in mu's place)
            metrics = basic_metrics(logp[dev, "fp32"], logp[dev, mode], mask)
            rows.append({"device": dev, "trainer": mode, **metrics})
    cross = []  # on a GPU: the CPU's (in mu's place) against the GPU's
    for mode in DTYPES if device == "cuda" else ():
        metrics = basic_metrics(logp["cpu", mode], logp["cuda", mode], mask)
        cross.append({"trainer": mode, **metrics})
    flags = {f: getattr(torch.backends.cuda.matmul, f) for f in CUDA_FLAGS}
    result = {"experiment": "trainer", "checkpoint": ckpt, "machine": machine(),
              "problems": len(problems), "tokens": int(mask.sum()), "cuda_matmul": flags,
              "gpu_ablation": args.gpu_ablation, "rows": rows, "cross_rows": cross,
              "layers": layers, "grads": grads}
    print_trainer(result)
    return result

def gradient_errors(model, idx, mask, dev, by_part=False):
    """The gradient of the answers' mean log-prob (the SFT's) from each 16-bit trainer against
    float32's: its relative error, and the share of entries non-zero there stored as 0;
    by_part: each part's own (PARTS), and its share of the squared error."""
    def mean_logp(mode):
        return (trainer_logprobs(model, mode, idx, dev) * mask).sum() / mask.sum()

    exact, rows = flat_grad(model, mean_logp("fp32")), []
    for mode, scale in [("bf16", 1.0), ("fp16", 1.0), ("fp16", INIT_SCALE)]:
        g = flat_grad(model, mean_logp(mode) * scale) / scale
        rows.append({"device": dev, "trainer": mode, "loss_scale": scale,
                     "weight_grad_zero": underflow(g, exact)[0],
                     "rel_error": ((g - exact).norm() / exact.norm()).item(),
                     **({"by_part": part_errors(model, g, exact)} if by_part else {})})
    return rows

def part_of(name):  # a parameter's part of the model, by its name
    return next((part for part in PARTS if part in name), "norms")

def part_errors(model, g, exact):
    """Each part's relative error and its share of the squared error (flat_grad's order)."""
    err, ref, start = {}, {}, 0
    for name, p in model.named_parameters():
        part, stop = part_of(name), start + p.numel()
        err[part] = err.get(part, 0.0) + (g[start:stop] - exact[start:stop]).pow(2).sum().item()
        ref[part] = ref.get(part, 0.0) + exact[start:stop].pow(2).sum().item()
        start = stop
    total = sum(err.values())
    return {part: {"rel_error": (err[part] / ref[part]) ** 0.5, "share": err[part] / total}
            for part in err}

def print_trainer(result):
    head = " ".join(f"{k[9:]:>17}" for k in KEYS)
    print(f"\nthe trainer half on {result['checkpoint']}: {result['problems']} held-out "
          f"problems' answers, {result['tokens']} tokens, --gpu-ablation "
          f"{result['gpu_ablation']}\n{machine_line(result['machine'])}\n"
          f"\neach 16-bit trainer against float32 on the same device\n"
          f"{'device':7} {'trainer':8} {head}")
    for r in result["rows"]:
        values = " ".join(f"{r[k]:>17.3e}" for k in KEYS)
        print(f"{r['device']:7} {r['trainer']:8} {values}")
    if result["cross_rows"]:
        print(f"\nthe GPU against the CPU, same trainer (cuBLAS {result['cuda_matmul']})\n"
              f"{'':7} {'trainer':8} {head}")
    for r in result["cross_rows"]:
        print(f"{'':7} {r['trainer']:8} " + " ".join(f"{r[k]:>17.3e}" for k in KEYS))
    print("\nwhere the error enters: RMS of (mode - fp32) over RMS of fp32, block by block, "
          "norm, logits")
    for dev, modes in result["layers"].items():
        for mode, errs in modes.items():
            print(f"{dev:7} {mode:8} " + " ".join(f"{e:>9.2e}" for e in errs))
    print("\nthe gradient of the answers' mean log-prob against float32's\n"
          f"{'device':7} {'trainer':8} {'scale':>9} {'weight grad 0':>14} {'rel. error':>11}")
    for g in result["grads"]:
        parts = "".join(f"  {part} {r['rel_error']:.2e} ({r['share']:.1%})"
                        for part, r in g.get("by_part", {}).items())
        print(f"{g['device']:7} {g['trainer']:8} {g['loss_scale']:>9.0f} "
              f"{g['weight_grad_zero']:>14.2%} {g['rel_error']:>11.2e}{parts}")

def sites_probe(device, seed=0):
    """The trainer's two sites on `device`, on random 16-bit inputs of the model's shapes: each
    output against the float32 result on the CPU (rounding.compare). Rows "rotary" and
    "attention" run as the 16-bit trainer does (Precision.logits_fn: on a CPU the emulation,
    on a GPU the native kernels, SDPA's pick; `equals`: the kernels it matches bit for bit);
    "attention_<kernel>", each of SDPA's kernels this device has, called plainly."""
    g, rows = torch.Generator().manual_seed(seed), {}
    cos, sin = rope_cos_sin(GPTConfig(n_embd=H * D, n_head=H), T, "cpu")
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        q, k, v = (torch.randn(BATCH, H, T, D, generator=g).to(dtype) for _ in range(3))
        rotated = torch.cat([-q[..., D // 2:], q[..., :D // 2]], -1).float()
        ref = q.float() * cos + rotated * sin  # on the CPU: float32, no fused multiply-add
        kernels = {name: sdpa(q, k, v, device, backend) for name, backend in BACKENDS.items()}
        kernels = {name: out for name, out in kernels.items() if out is not None}
        with TensorCoreMatmuls(dtype, strict=True) if device == "cpu" else nullcontext():
            rope = apply_rope(q.to(device), cos.to(device), sin.to(device)).cpu()
            out = sdpa(q, k, v, device)
        rows.setdefault("rotary", {})[label] = compare(rope, ref, dtype)
        ref, model = causal_attention(q, k, v), weights_rounded(q, k, v, dtype)
        outs = {"attention": out, **{f"attention_{n}": o for n, o in kernels.items()}}
        for name, o in {**outs, "attention_weights_rounded": model}.items():
            rows.setdefault(name, {})[label] = compare(o, ref, dtype)
        for name, o in outs.items():  # the share equal to the model, bit for bit
            rows[name][label]["match_weights_rounded"] = (o == model).float().mean().item()
        rows["attention"][label]["equals"] = [n for n, o in kernels.items() if torch.equal(o, out)]
    for name, row in rows.items():
        row["on_model_path"] = name in ("rotary", "attention")
    return {"experiment": "trainer-sites", "device": device, "machine": machine(), "ops": rows}

def print_sites(result):
    print(f"\nthe trainer's ops on {result['device']} against float32 on the same 16-bit "
          f"inputs, at the two sites\n{machine_line(result['machine'])}\n")
    print_rows(result["ops"])
    for label in ("bf16", "fp16"):  # on a CPU the trainer's attention is the emulation's
        row = result["ops"]["attention"][label]
        share = ", ".join(
            f"{name.removeprefix('attention_') if name != 'attention' else 'the trainer'} "
            f"{r[label]['match_weights_rounded']:.4f}"
            for name, r in result["ops"].items() if "match_weights_rounded" in r.get(label, {}))
        print(f"{label}: the trainer's attention equals bit for bit "
              f"{', '.join(row['equals']) or 'none of the kernels'}; equal to "
              f"weights_rounded: {share}")

def causal_scores(q, k):  # float32 on the CPU, (batch, heads, T, T)
    scores = q.float() @ k.float().transpose(-1, -2) * D ** -0.5
    return scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))

def causal_attention(q, k, v):  # the reference
    return causal_scores(q, k).softmax(-1) @ v.float()

def weights_rounded(q, k, v, dtype):
    """A fused kernel's attention as FlashAttention's is written (and rounding.py's model of
    AMX's): the softmax's weights, not yet normalized, rounded to the inputs' dtype (to
    nearest) for the P.V product on the tensor cores; their sum stays float32."""
    s = causal_scores(q, k)
    e = (s - s.amax(-1, keepdim=True)).exp()
    return ((e.to(dtype).float() @ v.float()) / e.sum(-1, keepdim=True)).to(dtype)

def sdpa(q, k, v, device, backend=None):
    """SDPA on `device`, causal, on one kernel (None: SDPA's pick); None where it has none."""
    try:
        with sdpa_kernel(backend) if backend else nullcontext():
            args = (x.to(device) for x in (q, k, v))
            return F.scaled_dot_product_attention(*args, is_causal=True).cpu()
    except RuntimeError:  # this kernel does not take this dtype, shape or device
        return None

def main(argv=None, engine=None):
    p = base_parser("the trainer half, no engine: the GPU against the CPU (the docstring)")
    ablations = ["none", "full-reduction", "math-attention", "both"]
    p.add_argument("--gpu-ablation", choices=ablations, default="none",
                   help="on a GPU: cuBLAS's 16-bit reductions off, and/or attention on "
                   "SDPA's math kernel")
    p.add_argument("--by-part", action="store_true",
                   help="each gradient error also by part of the model (embedding, attention, "
                   "MLP, head, norms), with its share of the squared error")
    p.add_argument("--embed32", action="store_true",
                   help="the CPU trainer's embedding backward summed in float32 (embed32.py)")
    p.add_argument("--sites", action="store_true",
                   help="how this device's trainer rounds at the rotary and attention outputs")
    args = parse(p, argv)
    if args.gpu_ablation != "none" and not torch.cuda.is_available():
        common.refuse("--gpu-ablation: the trainer half, on a GPU (none here)")
    if args.sites and (args.init or args.by_part or args.embed32 or args.gpu_ablation != "none"):
        common.refuse("--sites reads random inputs through the trainer's ops: it takes no "
                      "--init, --by-part, --embed32 or --gpu-ablation")
    if args.sites:
        result = sites_probe(get_precision("fp32").device, args.seed)
        print_sites(result)
        return common.finish(args, result)
    if args.embed32:  # before the trainer runs: its mode is read at each call
        embed32.install()
    return common.finish(args, {**trainer(args, engine), "embed_grad": embed32.MODES[args.embed32]})

if __name__ == "__main__":
    main()
