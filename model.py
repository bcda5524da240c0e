"""
model.py: a small Llama-style GPT, written from scratch, and its checkpoint format.

A network vLLM serves natively (LlamaForCausalLM): embedding, RMSNorm, "rotate half" RoPE,
causal attention, SwiGLU MLP, final norm, untied LM head. The parameters carry Hugging Face's
Llama names: a checkpoint is config.json + model.safetensors, and the same (name, tensor)
pairs feed vLLM's in-place weight reload during RL.

It teaches: the trainer's forward and the engine's are two implementations of one function.
In float32 they agree to ~1e-6 (tests/); in 16 bits they round differently: the mismatch.
"""
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# Head sizes vLLM's CPU attention accepts (GPUs accept these too).
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

@dataclass
class GPTConfig:
    vocab_size: int = 258
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_hidden: int = 384  # SwiGLU inner width
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    bos_id: int = 256
    eos_id: int = 257

    def __post_init__(self):
        head = self.n_embd // self.n_head
        if self.n_embd % self.n_head or head not in VLLM_HEAD_SIZES:
            raise ValueError(f"n_embd/n_head = {self.n_embd}/{self.n_head} must be a head "
                             f"size vLLM's attention accepts: {VLLM_HEAD_SIZES}")

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # In float32 whatever the activation dtype, as HF and vLLM do: a mean of squares in
        # 16 bits loses the small components first.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

def rope_cos_sin(cfg, T, device):
    """cos/sin for positions 0..T-1, "rotate half" layout (a head's two halves are the two
    coordinates of each rotated pair). In float32: positions x frequencies in 16 bits would
    be off by whole radians at long range."""
    head = cfg.n_embd // cfg.n_head
    f32 = dict(device=device, dtype=torch.float32)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head, 2, **f32) / head))
    freqs = torch.outer(torch.arange(T, **f32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()

def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, d = cfg.n_head, cfg.n_embd
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.n_hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 style init; residual projections scaled down by depth
                residual = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, head_dtype=None):
        """Token ids (B, T) -> logits (B, T, vocab), in the weights' dtype (precision.py runs it
        on 16-bit copies). head_dtype=float32: the head's inputs (hidden states, weight) cast to
        float32 and multiplied there, as vLLM's head_dtype: no 16-bit rounding of the logits."""
        cos, sin = rope_cos_sin(self.cfg, idx.shape[1], idx.device)
        x = self.embed_tokens(idx)
        for block in self.layers:
            x = block(x, cos, sin)
        h = self.norm(x)
        if head_dtype is None:
            return self.lm_head(h)
        return F.linear(h.to(head_dtype), self.lm_head.weight.to(head_dtype))

def token_logprobs(model, idx):
    """log p(idx[:, t+1] | idx[:, :t+1]) for every t: shape (B, T-1)."""
    return logprobs_of(model(idx[:, :-1]), idx)

def logprobs_of(logits, idx):
    """The log-prob of each next token in idx, from the logits of idx[:, :-1]. log_softmax in
    float32, whatever the logits' dtype: exactly what vLLM reports ("raw_logprobs")."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, idx[:, 1:, None]).squeeze(-1)

# ---------------------------------------------------------------------------------------------
# Checkpoint format: a Hugging Face Llama folder (config.json + model.safetensors), float32

def hf_named_tensors(model):
    """(hf_name, tensor) pairs of the live model: what vLLM loads, and rollout.py syncs."""
    for name, p in model.named_parameters():
        yield (name if name.startswith("lm_head") else "model." + name), p.detach()

def hf_config(cfg):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.n_hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
        "head_dim": cfg.n_embd // cfg.n_head, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "torch_dtype": "float32",
        "gpt_config": asdict(cfg),  # our own config: load_hf tells a checkpoint of ours
    }

def save_hf(model, out_dir):
    """Write each file under a temporary name, then rename it: never half a checkpoint."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    weights, config = os.path.join(out_dir, "model.safetensors"), os.path.join(out_dir, "config.json")
    # float32 on disk: the master weights, so every dtype's run starts from the same values.
    save_file({k: v.float().contiguous().cpu() for k, v in hf_named_tensors(model)}, weights + ".tmp")
    os.replace(weights + ".tmp", weights)
    with open(config + ".tmp", "w") as f:
        json.dump(hf_config(model.cfg), f, indent=2)
    os.replace(config + ".tmp", config)  # written last: its presence means complete

def load_hf(ckpt_dir, device="cpu"):
    """Read a checkpoint written by save_hf back into an identical GPT (float32)."""
    from safetensors.torch import load_file
    path, weights = os.path.join(ckpt_dir, "config.json"), os.path.join(ckpt_dir, "model.safetensors")
    if not os.path.isfile(path) or not os.path.isfile(weights):
        raise ValueError(f"{ckpt_dir} is not a checkpoint (needs config.json, model.safetensors)")
    hf = json.load(open(path))
    if "gpt_config" not in hf:
        raise ValueError(f"{ckpt_dir} is not a checkpoint written by model.py (no gpt_config)")
    model = GPT(GPTConfig(**hf["gpt_config"]))
    state = {k.removeprefix("model."): v for k, v in load_file(weights).items()}
    model.load_state_dict(state)
    return model.to(device)
