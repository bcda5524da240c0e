"""
experiments/rounding.py: the op-level rounding probe. How vLLM's CPU kernels turn a float32
result into bf16 (or fp16): to nearest, as the trainer does, or by truncation.

    python experiments/rounding.py --json results/MACHINE/rounding.json

For each op on this model's path, on random 16-bit inputs of the model's shapes: the kernel's
output against the float32 result of the same op on the same 16-bit inputs, rounded two ways,
to nearest even (torch's cast) and by truncation (the low 16 bits of the float32 dropped; bf16
only): the share of elements equal to each, the magnitude bias (the mean of (|out| - |ref|) /
|ref|: below 0, the kernel shrinks its outputs) and the mean relative error. vLLM's loader picks
the kernel library by the chip (vllm/platforms/cpu.py: `_C` with AVX-512-BF16, `_C_AVX512` with
AVX-512F, `_C_AVX2` otherwise); --library forces another where the chip can run it. Op
"on this model's path" says whether vLLM runs that kernel for model.py's Llama (aligned.py's
table): RMSNorm and SiLU run native torch there, so their kernels' rows are for reference. On
AMX, vLLM runs bf16 attention on AMX's kernel; the row attention_vec is the same library's
vector kernel beside it (AMX hidden), for reference, and attention_amx_model a model of AMX's
kernel (amx_attention_model: weights rounded to bf16 before V) with the share it matches.
The result, per chip, goes to results/<machine>/rounding*.json; the page: experiments/rounding.md.
"""

import torch

import common
from instruments import machine

LIBRARIES = {"_C": "avx512_bf16", "_C_AVX512": "avx512f", "_C_AVX2": "avx2"}  # and the flag
T, H, D, HIDDEN = 64, 4, 32, 384  # tokens, heads, head size, the MLP's width (model.py)

def load(library, amx=True):
    """Load `library` through vLLM's own loader (told what the chip supports, so that it
    picks that one); return the library it loaded. Forcing a library below `_C` also hides
    AMX: vLLM's AMX paths (its small-GEMM and attention kernels) live in `_C` only, and a chip
    with AMX has AVX-512-BF16, so vLLM takes them only with `_C`. amx=False hides AMX on the
    chip's own library too: `_C`'s vector kernels, which round (attention_vec's row)."""
    from vllm.platforms import current_platform
    if library:
        torch.cpu._is_avx512_supported = lambda: library != "_C_AVX2"
        torch.cpu._is_avx512_bf16_supported = lambda: library == "_C"
    if not amx or (library and library != "_C"):
        torch.cpu._is_amx_tile_supported = lambda: False
    current_platform.import_kernels()
    maps = open("/proc/self/maps").read()  # the .so the process mapped (its module may fail)
    return next(name for name in LIBRARIES if f"/vllm/{name}.abi3.so" in maps)

def refuse_unrunnable(library, hide_amx=False):
    """One line and exit 2 where this chip cannot run `library` (or has no AMX to hide)."""
    isa = machine()["cpu_isa"]
    if library and LIBRARIES[library] not in isa:
        common.refuse(f"--library {library}: this chip has no {LIBRARIES[library]}")
    if hide_amx and "amx_tile" not in isa:
        common.refuse("--hide-amx: this chip has no AMX to hide")

def truncated(x):  # float32 -> bf16 by dropping the low 16 bits: the #else branch's shift
    return (x.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

def compare(out, ref, dtype):
    """The kernel's output against the float32 reference, rounded both ways."""
    on = ref != 0
    rel = (out.float() - ref)[on] / ref[on].abs()
    row = {"match_nearest": (out == ref.to(dtype)).float().mean().item(),
           "magnitude_bias": ((out.float().abs() - ref.abs())[on] / ref.abs()[on]).mean().item(),
           "rel_error_mean": rel.abs().mean().item()}
    if dtype == torch.bfloat16:
        row["match_truncation"] = (out == truncated(ref)).float().mean().item()
    return row

def rotary(dtype, g):
    """_C.rotary_embedding, "rotate half", on q and k in place."""
    from vllm import _custom_ops as ops
    q = torch.randn(T, H * D, generator=g).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float), inv)
    table = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype)  # vLLM's cache, 16-bit
    out = q.clone()
    ops.rotary_embedding(torch.arange(T), out, q.clone(), D, table, True)
    x, c, s = q.float().view(T, H, D), *table.float()[:, None].chunk(2, -1)
    x1, x2 = x.chunk(2, -1)
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).view(T, H * D)
    return out, ref

def qkv(dtype, g):
    return [torch.randn(T, H, D, generator=g).to(dtype) for _ in range(3)]

def causal_scores(q, k):  # float32, as the reference's softmax takes them
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * D ** -0.5
    return scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))

def attention(dtype, g):
    """_C.cpu_attention_with_kv_cache, causal, through aligned.paged_attention."""
    import aligned
    q, k, v = qkv(dtype, g)
    out = aligned.paged_attention(q, k, v, 1, T)
    ref = torch.einsum("hts,shd->thd", causal_scores(q, k).softmax(-1), v.float())
    return out, ref

def amx_attention_model(q, k, v):
    """AMX's attention as read in vLLM's csrc/cpu/cpu_attn_amx.hpp: its
    P.V product multiplies bf16 tiles, so the softmax's weights, not yet
    normalized, are rounded to bf16 (to nearest) before they meet V;
    the sum they are divided by stays float32."""
    s = causal_scores(q, k)
    e = (s - s.amax(-1, keepdim=True)).exp()  # the weights before the division
    pv = torch.einsum("hts,shd->thd", e.to(torch.bfloat16).float(), v.float())
    return pv / e.sum(-1).transpose(0, 1)[..., None]

def linear(dtype, g):
    """The GEMM vLLM's loader picks for a weight (aligned.engine_linear)."""
    import aligned
    x = torch.randn(T, H * D, generator=g).to(dtype)
    w = (torch.randn(HIDDEN, H * D, generator=g) * 0.05).to(dtype)
    return aligned.engine_linear(w)(x, w, None), x.float() @ w.float().T

def rms_norm(dtype, g):
    """_C.rms_norm (the model's path runs native torch: for reference)."""
    x = torch.randn(T, H * D, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(H * D, generator=g)).to(dtype)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-5)
    xf = x.float()
    return out, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

def silu_and_mul(dtype, g):
    """_C.silu_and_mul (the model's path runs native torch: for reference)."""
    x = torch.randn(T, 2 * HIDDEN, generator=g).to(dtype)
    out = torch.empty(T, HIDDEN, dtype=dtype)
    torch.ops._C.silu_and_mul(out, x)
    a, b = x.float().chunk(2, -1)
    return out, torch.nn.functional.silu(a) * b

OPS = {"linear": (linear, True), "rotary_embedding": (rotary, True),
       "attention": (attention, True), "rms_norm": (rms_norm, False),
       "silu_and_mul": (silu_and_mul, False)}

def probe(library=None, seed=0):
    """Every op, in bf16 and fp16, on the library loaded; log_softmax is float32 in vLLM (the
    logits upcast first: model.logprobs_of does the same), so it has no 16-bit row."""
    loaded, rows = load(library), {}
    torch._C._cpu._init_amx()  # the kernel asks Linux for AMX's tiles first (else SIGILL)
    for name, (op, on_path) in OPS.items():
        rows[name] = {"on_model_path": on_path}
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            out, ref = op(dtype, torch.Generator().manual_seed(seed))
            rows[name][label] = compare(out, ref, dtype)
    from aligned import BLOCK_SIZE, _get_attn_isa  # vLLM's pick: "amx" on AMX, else vector
    isa = {label: _get_attn_isa(dt, BLOCK_SIZE, D, "auto")
           for dt, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"))}
    if isa["bf16"] == "amx":
        rows.update(amx_rows(rows["attention"]["bf16"], seed))
    return {"experiment": "rounding", "library": loaded, "attention_isa": isa,
            "machine": machine(), "ops": rows}

def amx_rows(kernel_row, seed):
    """On AMX: the kernel's outputs against amx_attention_model's (the
    share equal, into kernel_row); the model's own row against float32;
    the same library's vector kernel beside it, AMX hidden."""
    def inputs():  # attention()'s: qkv draws first from this generator
        return torch.Generator().manual_seed(seed)
    out, ref = attention(torch.bfloat16, inputs())  # AMX's kernel
    model = amx_attention_model(*qkv(torch.bfloat16, inputs()))
    model = model.to(torch.bfloat16)  # the kernel's output: to nearest
    kernel_row["match_amx_model"] = (out == model).float().mean().item()
    amx, torch.cpu._is_amx_tile_supported = torch.cpu._is_amx_tile_supported, lambda: False
    vec, _ = attention(torch.bfloat16, inputs())
    torch.cpu._is_amx_tile_supported = amx
    return {name: {"on_model_path": False, "bf16": compare(x, ref, torch.bfloat16)}
            for name, x in (("attention_amx_model", model), ("attention_vec", vec))}

def print_probe(result):
    print(f"\nvLLM's CPU ops against float32 on the same 16-bit inputs, library "
          f"{result['library']} (its attention kernel: {result['attention_isa']})\n"
          f"{common.machine_line(result['machine'])}\n")
    print_rows(result["ops"])
    if "match_amx_model" in result["ops"]["attention"]["bf16"]:
        print(f"\nAMX's attention equals amx_attention_model's in "
              f"{result['ops']['attention']['bf16']['match_amx_model']:.4f} of its outputs")

def print_rows(ops):
    """The probe's table: an op's rows, bf16 and fp16."""
    print("| op | on the model's path | dtype | matches round-to-nearest | matches truncation "
          "| magnitude bias | mean rel. error |\n|---|---|---|---|---|---|---|")
    for name, row in ops.items():
        for dtype in (d for d in ("bf16", "fp16") if d in row):
            r = row[dtype]
            trunc = f"{r['match_truncation']:.4f}" if "match_truncation" in r else "-"
            print(f"| {name} | {'yes' if row['on_model_path'] else 'no'} | {dtype} | "
                  f"{r['match_nearest']:.4f} | {trunc} | {r['magnitude_bias']:+.2e} | "
                  f"{r['rel_error_mean']:.2e} |")

def main(argv=None):
    p = common.parser("the op-level rounding probe (the docstring)")
    p.add_argument("--library", choices=list(LIBRARIES), default=None,
                   help="force this kernel library (default: the one vLLM picks)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    refuse_unrunnable(args.library)
    common.writable(args.json)
    result = probe(args.library)
    print_probe(result)
    return common.finish(args, result)

if __name__ == "__main__":
    main()
