"""
experiments/embed32.py: the CPU trainer's embedding backward, summed as a GPU sums it.

torch's CPU backward of a 16-bit embedding adds each position's gradient row into its token's
row of the weight's gradient in the weight's dtype: a token seen n times in a batch carries
about n roundings to bf16. A GPU's kernel sums in float32 and rounds once. trainer_half.py
--by-part found it (experiments/chips-gpu.md): on the 0.9M warm start the embedding carries
93-96 % of the bf16 emulation's squared gradient error against float32 on a CPU, 59 % on an
NVIDIA H200; the other parts agree within 1.05-1.28x. Every CPU run here carries it, on both
sides of every contrast; the mismatch, a forward quantity, does not see it.

install() gives the 16-bit trainer (precision.TensorCoreMatmuls, strict) an embedding whose
backward sums in float32 and rounds once to the dtype, as a GPU's; the forward is unchanged
(a gather rounds nothing), and so is every other parameter's gradient. Variants whose record
says embed_grad "float32" run with it (variants.py); the warm start (not strict) and float32
are untouched. What it changes in a run, against the truncating engine that makes GSPO fall
and the chip's rounding one:

    python experiments/campaign.py --plan embed32 --seeds 0 1 2 3 4 5 6 7
    python experiments/sites_figure.py results/MACHINE --variants bf16 bf16-embed32 \
        bf16-trunc bf16-trunc-embed32 --seeds 0 1 2 3 4 5 6 7 --out figures/embed32-amd.png

and what it changes in the gradient, part by part (the CPU's rows; a GPU's are its own):

    python experiments/trainer_half.py --by-part --embed32 --json F

install("reversed") is the neutral change beside it (embedrev.md): the rows summed in the
dtype as torch's kernel sums them, one rounding an add, but in the reverse order of positions:
an error of the same kind and size, another draw of it. Does any change of the trainer lift GSPO
against the truncating engine, or the float32 sums? Its size against torch's, on each seed's
warm start (the bf16 trainer's gradient of its mean answer log-prob, teacher-forced):

    python experiments/embed32.py --seeds 0 1 2 3 --json results/MACHINE/embed-sums.json

    mode       a token's rows summed                       roundings to the dtype
    dtype      in the dtype, first position first (torch)  one an add
    float32    in float32, then rounded (a GPU's kernel)   one
    reversed   in the dtype, last position first           one an add

Pages: experiments/embed32.md, experiments/embedrev.md. Left out: sparse gradients, max_norm
and scale_grad_by_freq (the model uses none; the mode leaves such a call to torch).
"""
import torch
import torch.nn.functional as F

import common
import layers
from variants import EMBED_GRAD as MODES  # torch's sums, a GPU's, torch's reversed

def sums_in_dtype(idx, rows, shape, reverse=False):
    """Each token's rows added one at a time in the rows' dtype, in the order of positions
    (reversed: last first): torch's CPU kernel's sums, to the bit, in its order (test_embed32)."""
    pos = torch.arange(idx.numel(), device=idx.device)
    pos = pos.flip(0) if reverse else pos
    tokens, order = torch.sort(idx[pos], stable=True)  # a token's positions, in the sum's order
    pos = pos[order]
    rank = torch.arange(len(pos), device=idx.device) - torch.searchsorted(tokens, tokens)
    by_rank = torch.argsort(rank, stable=True)  # every token's j-th row, then its (j+1)-th
    total = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
    for at in by_rank.split(torch.bincount(rank).tolist()):  # each token at most once in `at`
        # each add in float32, rounded to the dtype: one rounding an add, as the kernel's
        total[tokens[at]] = (total[tokens[at]].float() + rows[pos[at]].float()).to(rows.dtype)
    return total

class Embedding32(torch.autograd.Function):
    """F.embedding(idx, weight), its weight's gradient summed in float32 and rounded once, or
    in the dtype in the reverse order of positions (mode "reversed")."""
    @staticmethod
    def forward(ctx, idx, weight, mode):
        ctx.save_for_backward(idx)
        ctx.shape, ctx.dtype, ctx.mode = weight.shape, weight.dtype, mode
        return F.embedding(idx, weight)  # a gather: each row exact in the dtype

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        rows = grad.reshape(-1, ctx.shape[1])
        if ctx.mode == "reversed":  # the dtype's sums, another order: no GPU's reason
            return None, sums_in_dtype(idx.reshape(-1), rows.to(ctx.dtype), ctx.shape, True), None
        # float32: a token's rows add up as a GPU's accumulator adds them, exact enough that
        # the one rounding to the dtype below is the only one
        total = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device)
        total.index_add_(0, idx.reshape(-1), rows.float())
        return None, total.to(ctx.dtype), None

def plain(args, kwargs):
    """(idx, weight) of an F.embedding call with nothing but its defaults, else None."""
    names = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    defaults = dict(zip(names, (None, None, 2.0, False, False)))
    given = {**dict(zip(names, args[2:])), **(kwargs or {})}
    return args[:2] if all(given[k] == defaults[k] for k in given) else None

def handler(sums):
    """layers.add's handler: a plain F.embedding of the trainer's cast weight, summed `sums`."""
    def embedding(mode, func, args, kwargs):
        call = plain(args, kwargs) if func is F.embedding else None
        if call and call[1].dtype == mode.dtype:  # the 16-bit trainer's cast weight
            return Embedding32.apply(*call, sums)
        return None
    return embedding

def install(sums="float32"):
    """The 16-bit trainer's embedding backward summed `sums` (a MODES but torch's), for this
    process: a layer on the trainer's mode as it stands (sites.install first, where a variant
    has both)."""
    if sums not in MODES[1:]:
        raise ValueError(f"embed32.install: {sums!r} is not one of {MODES[1:]}")
    layers.add(handler(sums))
    return sums

uninstall = layers.remove  # the trainer's mode as it was before install

def rows_and_grad(model, idx, mask):
    """The bf16 trainer's gradient of its mean answer log-prob: the token ids the embedding
    reads, the rows torch's kernel sums (bf16, at its output), and its sums (at the weight)."""
    from offline import flat_grad, trainer_logprobs
    seen, e = {}, model.embed_tokens
    hooks = (e.register_forward_hook(lambda m, args, out: seen.update(idx=args[0])),
             e.register_full_backward_hook(lambda m, gi, go: seen.update(g=go[0].detach())))
    logp = trainer_logprobs(model, "bf16", idx, "cpu")
    grad = flat_grad(model, (logp * mask).sum() / mask.sum())
    for h in hooks:
        h.remove()
    w = e.weight  # flat_grad's first parameter
    rows = seen["g"].reshape(-1, w.shape[1]).to(torch.bfloat16)
    return seen["idx"].reshape(-1), rows, grad[:w.numel()].view(w.shape)

def sum_errors(seed):
    """Each way of summing seed's rows, its mean |error| against the exact (float64) sum over the
    entries a row reaches; torch's kernel checked against sums_in_dtype's forward order."""
    import sites
    from model import load_hf
    model = load_hf(sites.default_warm_start(seed), "cpu").eval()
    idx, mask = sites.teacher_forced(seed)
    idx, rows, torch_sums = rows_and_grad(model, idx, mask)
    shape = torch_sums.shape
    exact = torch.zeros(shape, dtype=torch.float64).index_add_(0, idx, rows.double())
    sums = {"dtype": sums_in_dtype(idx, rows, shape),
            "reversed": sums_in_dtype(idx, rows, shape, reverse=True),
            "float32": exact.to(torch.bfloat16)}  # a GPU's one rounding (of the exact sum)
    live = exact != 0  # entries no row reaches are 0 every way
    err = {k: (v.double() - exact)[live].abs().mean().item() for k, v in sums.items()}
    moved = (sums["reversed"] != sums["dtype"])[live].double().mean().item()
    return {"seed": seed, "mean_abs_error": err, "moved": moved,
            "reversed_over_dtype": err["reversed"] / err["dtype"],
            "dtype_is_torchs": torch.equal(sums["dtype"], torch_sums.to(torch.bfloat16))}

def main(argv=None):
    p = common.parser("each way of summing the embedding's rows, its error (the docstring)")
    p.add_argument("--seeds", type=common.at_least(0), nargs="+", default=[0])
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    common.writable(args.json)
    from instruments import machine
    rows = [sum_errors(s) for s in args.seeds]
    print("seed  mean |error| a gradient entry: torch's   reversed   float32   rev/torch  moved")
    for r in rows:
        e = r["mean_abs_error"]
        print(f"{r['seed']:4}  {e['dtype']:.3e}  {e['reversed']:.3e}  {e['float32']:.3e}  "
              f"{r['reversed_over_dtype']:.3f}  {r['moved']:.3f}"
              f"{'' if r['dtype_is_torchs'] else '  torch differs from its model'}")
    return common.finish(args, {"machine": machine(), "seeds": rows})

if __name__ == "__main__":
    main()
