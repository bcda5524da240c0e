"""
precision.py: everything that depends on the dtype, and the training-inference mismatch metrics.

One function, get_precision("fp16" | "bf16" | "fp32"), decides for a whole run:
  - the trainer's compute dtype: master weights stay float32, the forward runs under autocast in
    this dtype (what mixed-precision training of real models does),
  - the dtype string the vLLM engine serves the same weights in,
  - a torch.amp.GradScaler, enabled for fp16 only. FP16 has 10 mantissa bits but 5 exponent bits:
    its smallest normal number is 6e-5, so small gradients underflow to zero unless the loss is
    multiplied by a large scale before backward (and the gradients divided by it after). BF16 has
    float32's 8 exponent bits and never needs it; fp32 neither. Nothing else in the code branches
    on the dtype: a disabled scaler's scale/unscale_/step/update are plain pass-throughs.

`python precision.py` prints the three formats side by side, shows how a log-prob summed over a
sequence drifts when each token's log-prob is rounded to 16 bits, and times a 16-bit matmul on the CPU.
"""
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VLLM_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass
class Precision:
    name: str                 # fp16, bf16 or fp32
    dtype: torch.dtype        # trainer compute dtype (autocast) and engine dtype
    vllm_dtype: str           # the same dtype, spelled for vllm.LLM(dtype=...)
    device: str               # "cuda" when present, else "cpu"

    def autocast(self):
        """The trainer's forward: matmuls in `dtype`, float32 master weights and residual stream."""
        if self.dtype == torch.float32:
            return nullcontext()
        if self.device == "cpu":
            return Emulated16BitMatmuls(self.dtype)
        return torch.autocast(device_type=self.device, dtype=self.dtype)

    def grad_scaler(self):
        # Dynamic loss scaling: start at 2**16, halve on an inf/nan gradient (and skip that step),
        # double after 2000 clean steps. Enabled for fp16 only; elsewhere every call passes through.
        return torch.amp.GradScaler(self.device, enabled=self.name == "fp16")


class Emulated16BitMatmuls(TorchFunctionMode):
    """Autocast for CPUs, computed the way a GPU's tensor cores compute it.

    A GPU's fp16/bf16 matmul takes 16-bit inputs, multiplies and accumulates in float32, and rounds
    the result to 16 bits. Most CPUs have no such instruction and PyTorch's fallback fp16 matmul is
    50-100x slower than float32 (bf16 about 3x). So here: round the inputs of every linear and
    attention to `dtype`, run the op in float32 (a product of two 16-bit numbers is exact in float32),
    round the output to `dtype`: the linear layers round where torch.autocast rounds, forward and
    backward (the gradient reaching a 16-bit tensor is itself rounded to 16 bits, so fp16 gradients
    can underflow and the GradScaler matters). Attention differs inside: 16-bit attention kernels also
    round the softmax probabilities before the second matmul, which this keeps in float32. So it
    matches autocast's error in size (tests/test_model.py), not bit for bit."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (F.linear, F.scaled_dot_product_attention):
            return func(*args, **kwargs)

        def round_to_16(t):
            return t.to(self.dtype).float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        out = func(*map(round_to_16, args), **{k: round_to_16(v) for k, v in kwargs.items()})
        return out.to(self.dtype)


def get_precision(name, device=None):
    key = ALIASES.get(str(name).lower())
    if key is None:
        raise ValueError(f"--dtype must be one of fp16, bf16, fp32 (or float16, bfloat16, float32), got {name!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if key == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("--dtype bf16: this GPU has no bfloat16 support (use fp16 or fp32)")
    return Precision(key, TORCH_DTYPE[key], VLLM_DTYPE[key], device)


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
    Computed in float64: the fp32 run's mismatch is ~1e-7 per token, and r - 1 - log r at that size
    cancels to zero in float32."""
    d = (mu_logp.double() - pi_logp.double()) * mask
    m = mask.double()
    n = m.sum().clamp(min=1)
    log_r = -d
    k3 = (torch.exp(log_r) - 1 - log_r) * m
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

    # Why the trainer emulates 16-bit matmuls on a CPU (Emulated16BitMatmuls): most CPUs have no
    # 16-bit matrix instructions, and PyTorch's fallback is far slower than float32.
    a = torch.randn(512, 512, generator=g)
    print("\nSpeed of a 512 x 512 matmul on this CPU, relative to float32 (median of 10):")
    ms = {}
    for name, dt in TORCH_DTYPE.items():
        x, times = a.to(dt), []
        for _ in range(10):
            t0 = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - t0)
        ms[name] = sorted(times)[5] * 1e3
    for name, t in ms.items():
        print(f"{name:9} {t:8.2f} ms  {t / ms['fp32']:6.1f}x")


if __name__ == "__main__":
    _teach()
