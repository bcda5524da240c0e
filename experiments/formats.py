"""
experiments/formats.py: the three formats side by side, and why 3 mantissa bits matter.

    python experiments/formats.py

Prints each format's bits, epsilon and range, and how a sequence log-prob drifts when each token's
log-prob is rounded to the format (the log of the sequence-level importance weight). What each
dtype costs the trainer and the engine is measured by `probe.py mismatch`.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from precision import TORCH_DTYPE  # noqa: E402

print(f"{'dtype':6} {'mantissa':>8} {'exponent':>8} {'epsilon':>10} {'largest':>10} {'smallest normal':>16}")
for name, dt in TORCH_DTYPE.items():
    fi, mantissa = torch.finfo(dt), {"fp32": 23, "fp16": 10, "bf16": 7}[name]
    print(f"{name:6} {mantissa:>8} {fi.bits - 1 - mantissa:>8} {fi.eps:>10.2e} {fi.max:>10.2e} {fi.tiny:>16.2e}")

print("\nDrift of a sequence log-prob: T per-token log-probs (uniform in [-2, 0]) each rounded to the dtype,"
      "\nthen summed exactly; mean |error| of the sum over 256 sequences:\n")
g = torch.Generator().manual_seed(0)
print(f"{'T':>6} " + " ".join(f"{n:>10}" for n in TORCH_DTYPE) + f" {'bf16/fp16':>10}")
for T in (16, 64, 256, 1024, 4096):
    logps = -torch.rand(256, T, generator=g, dtype=torch.float64) * 2.0
    errs = {n: (logps.to(dt).double().sum(1) - logps.sum(1)).abs().mean().item() for n, dt in TORCH_DTYPE.items()}
    print(f"{T:>6} " + " ".join(f"{e:>10.2e}" for e in errs.values()) + f" {errs['bf16'] / errs['fp16']:>10.1f}")
print("\nThe error grows like sqrt(T), and bf16's is about 2**3 times fp16's: 3 fewer mantissa bits.")
