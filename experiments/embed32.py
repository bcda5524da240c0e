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

Page: experiments/embed32.md. Left out: sparse gradients, max_norm and scale_grad_by_freq
(the model uses none; the mode leaves such a call to torch).
"""
import torch
import torch.nn.functional as F

import layers
from variants import EMBED_GRAD as MODES  # torch's CPU kernel's sums, or a GPU's

class Embedding32(torch.autograd.Function):
    """F.embedding(idx, weight), its weight's gradient summed in float32, rounded once."""
    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        ctx.shape, ctx.dtype = weight.shape, weight.dtype
        return F.embedding(idx, weight)  # a gather: each row exact in the dtype

    @staticmethod
    def backward(ctx, grad):
        (idx,) = ctx.saved_tensors
        # float32: a token's rows add up as a GPU's accumulator adds them, exact enough that
        # the one rounding to the dtype below is the only one
        total = torch.zeros(ctx.shape, dtype=torch.float32, device=grad.device)
        total.index_add_(0, idx.reshape(-1), grad.reshape(-1, ctx.shape[1]).float())
        return None, total.to(ctx.dtype)

def plain(args, kwargs):
    """(idx, weight) of an F.embedding call with nothing but its defaults, else None."""
    names = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    defaults = dict(zip(names, (None, None, 2.0, False, False)))
    given = {**dict(zip(names, args[2:])), **(kwargs or {})}
    return args[:2] if all(given[k] == defaults[k] for k in given) else None

def embedding(mode, func, args, kwargs):
    """layers.add's handler: a plain F.embedding of the trainer's cast weight, summed in float32."""
    call = plain(args, kwargs) if func is F.embedding else None
    if call and call[1].dtype == mode.dtype:  # the 16-bit trainer's cast weight
        return Embedding32.apply(*call)
    return None

def install():
    """The 16-bit trainer's embedding backward in float32, for this process: a layer on the
    trainer's mode as it stands (sites.install first, where a variant has both)."""
    layers.add(embedding)
    return MODES[1]

uninstall = layers.remove  # the trainer's mode as it was before install
