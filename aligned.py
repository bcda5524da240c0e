"""
aligned.py: the trainer on the engine's own kernels (--trainer-kernels engine, CPU only).

The fix the discussion calls "aligned kernels" (Ling's kernel alignment; vLLM and TorchTitan's
bitwise-consistent RL): the trainer's forward calls the very ops vLLM's CPU engine runs for
this model, on the trainer's current 16-bit weights, so its log-probs equal the engine's bit
for bit and the mismatch is exactly 0. The backward is each op's textbook derivative. What
vLLM 0.32 runs for a Llama on a CPU (found with torch.profiler around a prefill):

  op                   the engine's kernel (called here)       the backward here
  linears, LM head     vLLM's CPU GEMM dispatch: oneDNN, sgl   the trainer's matmuls: 16-bit
                       (AMX) or torch's F.linear (fp16 here)   inputs, float32 sums, rounded
  RMSNorm (+residual)  vLLM's native torch code: the sum and   autograd
                       the statistics in float32
  RoPE                 _C.rotary_embedding, a 16-bit table     the same kernel, sin -> -sin
  SiLU and mul         native torch                            autograd
  attention            _C.cpu_attention_with_kv_cache, keys    textbook, in float32
                       and values in the engine's paged cache
  log_softmax          float32 (model.logprobs_of)             autograd

It teaches: the mismatch is two implementations of one function; run one and it is 0. What
remains is the 16-bit format's own rounding, now the same on both sides, and batch variance:
oneDNN's bf16 GEMM rounds some rows otherwise at a few batch sizes (3 of 259 for the LM
head), so a token the engine computed in such a batch differs (experiments/aligned.md).
Left out: GPUs (other kernels; there vLLM's batch-invariant mode and TorchTitan do this), the
fp32 LM head, models other than model.py's. tests/test_aligned.py checks values and gradients.
"""
import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

BLOCK_SIZE = 128  # tokens per block of vLLM's CPU KV cache (its default): the kernel walks them

def engine_linear(w):
    """The GEMM vLLM's loader picks for an (N, K) weight on this CPU, picked the same way; per
    forward, since the weights move (the oneDNN handle packs them)."""
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(w.detach(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=False)
    return holder.cpu_linear

class Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return engine_linear(w)(x, w, None)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        # As precision.TensorCoreMatmuls: 16-bit inputs, float32 products and sums, rounded.
        gx = (g.float() @ w.float()).to(x.dtype)
        gw = (g.float().t() @ x.float()).to(w.dtype)
        return gx, gw

class Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, pos, table, head):
        q, k = (t.clone(memory_format=torch.contiguous_format) for t in (q, k))  # in place: copies
        ops.rotary_embedding(pos, q, k, head, table, True)  # True: "rotate half" (neox)
        ctx.save_for_backward(pos, table)
        ctx.head = head
        return q, k

    @staticmethod
    def backward(ctx, gq, gk):
        pos, table = ctx.saved_tensors
        cos, sin = table.chunk(2, dim=-1)
        # A rotation's transpose is the rotation back: the same kernel, the angle negated.
        gq, gk = (t.clone(memory_format=torch.contiguous_format) for t in (gq, gk))
        ops.rotary_embedding(pos, gq, gk, ctx.head, torch.cat([cos, -sin], -1), True)
        return gq, gk, None, None, None

def paged_attention(q, k, v, B, T):
    """q, k, v: (B*T, heads, head) of B sequences of T tokens -> causal attention, by the
    engine's kernel on a KV cache laid out as the engine's (sequence b owns blocks b*n..)."""
    _, H, D = q.shape
    isa = _get_attn_isa(q.dtype, BLOCK_SIZE, D, "auto")
    n = -(-T // BLOCK_SIZE)  # blocks per sequence
    lens = torch.full((B,), T, dtype=torch.int32)
    starts = torch.arange(B + 1, dtype=torch.int32) * T
    table = torch.arange(B * n, dtype=torch.int32).view(B, n)
    at = torch.arange(T)
    slots = (table[:, at // BLOCK_SIZE].long() * BLOCK_SIZE + at % BLOCK_SIZE).flatten()
    cache = torch.zeros(B * n, H, 2 * BLOCK_SIZE, D, dtype=q.dtype)  # keys, then values
    keys, values = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, keys, values, slots, isa)
    plan = ops.cpu_attn_get_scheduler_metadata(B, H, H, D, lens, q.dtype, starts, True, -1,
                                               isa, True)  # causal, no window, split KV
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(q, keys, values, out, starts, lens, D ** -0.5, True, None,
                                    -1, table, 0, plan, None)  # no alibi, window, softcap
    return out

class Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, B, T):
        ctx.save_for_backward(q, k, v)
        ctx.shape = B, T
        return paged_attention(q, k, v, B, T)

    @staticmethod
    def backward(ctx, g):
        (B, T), saved = ctx.shape, ctx.saved_tensors
        # float32: the probabilities recomputed, then dS = P * (dP - rowsum(dP * P)).
        q, k, v, g = (t.float().reshape(B, T, *t.shape[1:]).transpose(1, 2) for t in (*saved, g))
        scale = q.shape[-1] ** -0.5
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        p = (q @ k.transpose(-1, -2) * scale).masked_fill(future, float("-inf")).softmax(-1)
        gp = g @ v.transpose(-1, -2)
        gs = p * (gp - (gp * p).sum(-1, keepdim=True))
        grads = (gs @ k * scale, gs.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ g)
        back = lambda t: t.transpose(1, 2).reshape(B * T, *saved[0].shape[1:])  # noqa: E731
        return (*(back(t).to(saved[0].dtype) for t in grads), None, None)

def rms_norm(x, w, eps, residual=None):
    """vLLM's native (fused_add_)rms_norm: the residual sum in float32, rounded for the
    stream, and the statistics of the unrounded sum. Returns (normed, new residual)."""
    h = x.float() if residual is None else x.float() + residual.float()
    residual = x if residual is None else h.to(x.dtype)
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h.to(w.dtype) * w).to(x.dtype), residual

def rope_table(cfg, dtype):
    """vLLM's cos/sin cache, computed as it computes it (float32), stored in the model dtype."""
    head = cfg.n_embd // cfg.n_head
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head, 2, dtype=torch.float) / head))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)

def fire(module, inputs, output):
    """The module's forward hooks, given the engine's values (the instruments read them)."""
    for hook in module._forward_hooks.values():
        hook(module, inputs, output)

def forward(model, dtype):
    """As precision.Precision.logits_fn: idx (B, T) -> logits (B, T, vocab) in `dtype`, each row
    computed as the engine computes one sequence; differentiable in the float32 master weights.
    The hooks of model.norm (train_grpo.score) and of each block (experiments/offline.py
    layer_errors) fire with the final norm's input and output, and the residual stream after
    each block."""
    cfg = model.cfg
    H, D, eps = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.norm_eps
    table = rope_table(cfg, dtype)

    def run(idx):
        W = {n: p.to(dtype) for n, p in model.named_parameters()}  # the cast is differentiable
        B, T = idx.shape
        pos = torch.arange(T).repeat(B)
        x, residual = F.embedding(idx.flatten(), W["embed_tokens.weight"]), None
        for i in range(cfg.n_layer):
            w = lambda name: W[f"layers.{i}.{name}.weight"]  # noqa: E731
            h, residual = rms_norm(x, w("input_layernorm"), eps, residual)
            # The engine's fused projections: one GEMM for q, k, v and one for gate, up.
            qkv = torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")])
            q, k, v = Linear.apply(h, qkv).split(cfg.n_embd, dim=-1)
            q, k = Rope.apply(q, k, pos, table, D)
            y = Attention.apply(q.view(-1, H, D), k.view(-1, H, D), v.view(-1, H, D), B, T)
            x = Linear.apply(y.view(-1, cfg.n_embd), w("self_attn.o_proj"))
            h, residual = rms_norm(x, w("post_attention_layernorm"), eps, residual)
            gate_up = Linear.apply(h, torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
            gate, up = gate_up.split(cfg.n_hidden, dim=-1)
            x = Linear.apply(F.silu(gate) * up, w("mlp.down_proj"))
            if model.layers[i]._forward_hooks:  # the stream the next norm forms, rounded
                fire(model.layers[i], (None,), (x + residual).view(B, T, -1))
        h, residual = rms_norm(x, W["norm.weight"], eps, residual)
        fire(model.norm, (residual.view(B, T, -1),), h.view(B, T, -1))
        return Linear.apply(h, W["lm_head.weight"]).view(B, T, -1)
    return run
