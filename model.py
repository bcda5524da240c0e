"""
model.py: a small Llama-style GPT, written from scratch, and its checkpoint format.

A network vLLM serves natively (LlamaForCausalLM), with Hugging Face's Llama names: a
checkpoint is config.json + model.safetensors; the same pairs feed vLLM's weight reload.

It teaches: the trainer's forward and the engine's are two implementations of one function:
in float32 they agree to ~1e-6; in 16 bits they round differently. Left out: dropout.
"""
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

# Head sizes vLLM's CPU attention accepts (GPUs too).
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
MAX_SEQ_LEN = 512  # positions: the warm start's time grows with them (128: 4 min, 2 cores)

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
        if self.max_seq_len > MAX_SEQ_LEN:  # --n-items 5000 would train for hours
            raise ValueError(f"{self.max_seq_len} positions (--n-items, --max-new-tokens): "
                             f"max {MAX_SEQ_LEN}")

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
    def forward(self, x):  # float32 statistics, as HF and vLLM: 16 bits lose small parts
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

def rope_cos_sin(cfg, T, device):
    """cos/sin, "rotate half" layout; float32: 16 bits are off by radians at long range."""
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
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(d, d, bias=False) for _ in range(4))
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
        """Token ids (B, T) -> logits (B, T, vocab) in the weights' dtype. head_dtype=float32:
        the head's inputs cast to float32 and multiplied there, as vLLM's head_dtype does."""
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
    """Each next token's log-prob: log_softmax in float32, as vLLM reports (raw_logprobs)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, -1, idx[:, 1:, None]).squeeze(-1)

def pack(prompts, responses, device, logprobs=None, pad=GPTConfig.eos_id):
    """(N, T) ids right-padded with the end token; the (N, T-1) mask of response tokens
    (token_logprobs' layout); the engine's log-probs in the same layout (or zeros)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    T = max(len(s) for s in seqs)
    idx = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask, mu = torch.zeros(len(seqs), T - 1), torch.zeros(len(seqs), T - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        idx[i, :len(p) + len(r)] = torch.tensor(p + r)
        where = slice(len(p) - 1, len(p) - 1 + len(r))
        mask[i, where] = 1.0
        if logprobs is not None:
            mu[i, where] = torch.tensor(logprobs[i])
    return idx.to(device), mask.to(device), mu.to(device)

def hf_named_tensors(model):  # (HF name, tensor) pairs: what vLLM loads, and rollout.py syncs
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
        "torch_dtype": "float32", "gpt_config": asdict(cfg)}  # ours: read_config checks it

def write_atomic(path, data):
    """data: text, or save(tmp) writing the file; then a rename: a kill leaves the old file
    or the new, never half of one."""
    if callable(data):
        data(path + ".tmp")
    else:
        Path(path + ".tmp").write_text(data)
    os.replace(path + ".tmp", path)

def save_hf(model, out_dir):
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, "model.safetensors")
    # float32 on disk: the master weights, so every dtype's run starts from the same values.
    state = {k: v.float().contiguous().cpu() for k, v in hf_named_tensors(model)}
    write_atomic(weights, lambda tmp: save_file(state, tmp))
    config = json.dumps(hf_config(model.cfg), indent=2)
    write_atomic(os.path.join(out_dir, "config.json"), config)  # last: the folder is complete

def read_config(ckpt_dir):  # the GPTConfig of a folder save_hf wrote; else ValueError
    path, weights = (os.path.join(ckpt_dir, f) for f in ("config.json", "model.safetensors"))
    if not os.path.isfile(path) or not os.path.isfile(weights):
        raise ValueError(f"{ckpt_dir} is not a checkpoint (needs config.json, model.safetensors)")
    hf = json.load(open(path))
    if "gpt_config" not in hf:
        raise ValueError(f"{ckpt_dir} is not a checkpoint written by model.py (no gpt_config)")
    return GPTConfig(**hf["gpt_config"])

def load_hf(ckpt_dir, device="cpu"):  # what save_hf wrote, as an identical GPT (float32)
    from safetensors.torch import load_file
    model = GPT(read_config(ckpt_dir))
    weights = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    model.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    return model.to(device)
