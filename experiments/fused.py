"""
experiments/fused.py: the CPU trainer's attention as a GPU's fused kernel computes it.

The 16-bit trainer on a CPU (precision.TensorCoreMatmuls) computes SDPA in float32 from
16-bit inputs and rounds the output once. A GPU's fused kernel (FlashAttention, cuDNN,
SDPA's pick on an NVIDIA H200) rounds inside: the softmax's weights, not yet normalized, are
rounded to the inputs' dtype for the P.V product on the tensor cores, their sum stays float32
(chips-gpu.md: every fused kernel there equals this model on 99.97 % of its bf16 outputs):

    step            the emulation (attention_weights "float32")   a fused kernel ("dtype")
    s = q.k^T / sqrt(D), causal     float32, from 16-bit q, k     the same
    e = exp(s - max s)              float32                       float32, then to the dtype
    y = (e.v) / sum e               float32, to the dtype once    e's 16-bit copy times v,
                                                                  float32 sums, to the dtype

Its error at the op is about 8x the emulation's and zero-mean (to nearest, both roundings).
install() gives the 16-bit trainer (strict) that attention; with embed32.install, the CPU
trainer is the nearest to a GPU's that these machines run (variants.py: attention_weights;
page experiments/gpulike.md). The backward is autograd's through the float32 expression, the
weights' rounding passed straight through (as a cast's), q, k and v's gradients rounded to the
dtype as the emulation rounds each; a fused kernel's backward, which also rounds P and dS to
the dtype for its own products, is left out. Left out too: masks other than causal, dropout,
another scale (the model calls none).
"""
import math

import torch
import torch.nn.functional as F

import layers
import precision
from variants import ATTENTION_WEIGHTS as MODES  # the emulation's, or a fused kernel's

def weights_rounded(q, k, v, dtype):
    """Causal attention of (..., T, D) 16-bit q, k, v, its weights rounded to dtype before V:
    the float32 result (the caller rounds it to the dtype)."""
    T, D = q.shape[-2], q.shape[-1]
    s = q.float() @ k.float().transpose(-1, -2) * D ** -0.5  # trainer_half's, to the bit
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    e = (s - s.amax(-1, keepdim=True)).exp()
    # to nearest in the dtype, as the kernel's cast; straight through: the gradient unrounded
    e16 = e + (e.to(dtype).float() - e).detach()
    return (e16 @ v.float()) / e.sum(-1, keepdim=True)  # float32 sums, the dtype's weights

def plain(args, kwargs):
    """(q, k, v) of a causal SDPA call with nothing else but its defaults, else None."""
    names = ("attn_mask", "dropout_p", "is_causal", "scale")
    given = {**dict(zip(names, args[3:])), **(kwargs or {})}
    expected = {"attn_mask": None, "dropout_p": 0.0, "is_causal": True, "scale": None}
    fits = given.get("is_causal") and all(given[k] == expected.get(k) for k in given)
    return args[:3] if fits else None

def attention(mode, func, args, kwargs):
    """layers.add's handler: a plain causal SDPA of the trainer's dtype, as a fused kernel's."""
    call = plain(args, kwargs) if func is F.scaled_dot_product_attention else None
    if call and all(t.dtype == mode.dtype for t in call):
        # the output rounded once, to nearest, as the kernel writes it
        return weights_rounded(*call, mode.dtype).to(mode.dtype)
    return None

def install():
    """The 16-bit trainer's attention as a fused kernel's, for this process: a layer on the
    trainer's mode as it stands (refused with sites' rounding: both round the output)."""
    if getattr(precision.TensorCoreMatmuls, "mode", "rne") != "rne":
        raise ValueError("fused attention with a site rounding: one rounds what the other does")
    layers.add(attention)
    return MODES[1]

uninstall = layers.remove  # the trainer's mode as it was before install
