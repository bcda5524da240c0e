"""
precision.py: the one place a dtype is decided, and the mismatch metrics.

get_precision decides, for a run: how the trainer computes (as FSDP's param_dtype: float32
master weights cast to the dtype; the backward in 16 bits), the engine's dtype, the LM
head's, and a GradScaler for fp16, whose backward flushes gradients below 6e-5 to zero
unless the loss is scaled up first (bf16 has fp32's exponent range).

    format  mantissa bits  exponent bits  epsilon  smallest normal  (torch.finfo)
    fp32    23             8              1.2e-7   1.2e-38
    fp16    10             5              9.8e-4   6.1e-5
    bf16    7              8              7.8e-3   1.2e-38

A CPU emulates 16-bit matmuls as tensor cores compute them. Left out: fp8.
"""
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

DTYPES = ("fp16", "bf16", "fp32")
TORCH_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
VLLM_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# fp16's loss scale starts at 2**16 (PyTorch's default) and tries doubling after 10 clean
# steps (PyTorch: 2000, the verl patch: 400): in 40 steps, 2000 would never probe overflow.
INIT_SCALE = 2.0 ** 16
GROWTH_INTERVAL = 10

@dataclass
class Precision:
    name: str                  # the trainer's dtype: fp16, bf16 or fp32
    dtype: torch.dtype         # ... as a torch dtype
    engine_dtype: torch.dtype  # what the engine serves the weights in (the sync casts)
    vllm_dtype: str            # the same, spelled for vllm.LLM(dtype=...)
    head_fp32: bool            # the LM head in float32 on both sides
    device: str                # "cuda" when present, else "cpu"
    kernels: str = "torch"     # "engine": the trainer runs vLLM's CPU kernels (aligned.py)
    def logits_fn(self, model):
        """The trainer's forward, as a function idx -> logits on the master weights cast to
        dtype (the model itself in fp32)."""
        head_dtype = torch.float32 if self.head_fp32 else None
        if self.dtype == torch.float32:
            return model
        if self.kernels == "engine":
            import aligned  # only when asked
            return aligned.forward(model, self.dtype)
        # On CUDA the 16-bit kernels are native; a CPU emulates them.
        on_cpu = self.device == "cpu"
        ops = TensorCoreMatmuls(self.dtype, strict=True) if on_cpu else nullcontext()

        def run(idx):
            weights = {n: p.to(self.dtype) for n, p in model.named_parameters()}
            with ops:
                return functional_call(model, weights, (idx,), {"head_dtype": head_dtype})
        return run

    def grad_scaler(self):  # halve on inf/nan (and skip), double after clean steps
        return torch.amp.GradScaler(self.device, init_scale=INIT_SCALE,
                                    growth_interval=GROWTH_INTERVAL,
                                    enabled=self.name == "fp16")

def autocast(name, device):
    """The warm start's mixed precision: float32 weights, only the matmuls in 16 bits."""
    if device == "cpu":
        return TensorCoreMatmuls(TORCH_DTYPE[name], strict=False)
    return torch.autocast(device_type=device, dtype=TORCH_DTYPE[name])

def get_precision(name, engine=None, lm_head="same", device=None, kernels="torch"):
    """The trainer's dtype, the engine's, the LM head's, the trainer's kernels."""
    engine = engine or name
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    no_bf16 = device == "cuda" and not torch.cuda.is_bf16_supported()
    if "bf16" in (name, engine) and no_bf16:
        raise ValueError("bf16: this GPU has no bfloat16 support (use fp16 or fp32)")
    alike = (engine, lm_head, device) == (name, "same", "cpu")  # what aligned.py serves
    if kernels == "engine" and (name == "fp32" or not alike):
        raise ValueError("--trainer-kernels engine: bf16 or fp16 on a CPU, engine and head alike")
    return Precision(name, TORCH_DTYPE[name], TORCH_DTYPE[engine], VLLM_DTYPE[engine],
                     lm_head == "fp32", device, kernels)

# Every matmul-class op a forker might write: on a GPU, each a tensor-core kernel.
T = torch.Tensor
MATMULS = {F.linear, F.scaled_dot_product_attention, torch.matmul, torch.mm, torch.bmm,
           torch.einsum, torch.addmm, torch.baddbmm, T.matmul, T.__matmul__, T.__rmatmul__,
           T.mm, T.bmm}
CASTS = {T.float, T.to, T.type, T.double}  # explicit, so allowed

class TensorCoreMatmuls(TorchFunctionMode):
    """16-bit matmuls on a CPU as tensor cores compute them: inputs rounded to dtype,
    products summed in float32 (exact there), the result rounded to dtype; so is each
    gradient. strict (the 16-bit trainer): promoting 16-bit inputs to float32 raises."""
    def __init__(self, dtype, strict):
        super().__init__()
        self.dtype, self.strict = dtype, strict
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        all_fp32 = all(t.dtype == torch.float32 for t in tensors)
        if func in MATMULS and not (self.strict and all_fp32):
            def to_f32(t):
                is_float = isinstance(t, torch.Tensor) and t.is_floating_point()
                return t.to(self.dtype).float() if is_float else t
            args, kwargs = tree_map(to_f32, (args, kwargs))
            return func(*args, **kwargs).to(self.dtype)
        out = func(*args, **kwargs)
        is_fp32 = isinstance(out, torch.Tensor) and out.dtype == torch.float32
        promoted = is_fp32 and func not in CASTS
        if self.strict and promoted and any(t.dtype == self.dtype for t in tensors):
            name = getattr(func, "__name__", func)
            raise RuntimeError(f"{name} turned {self.dtype} inputs into a float32 output: cast "
                               f"explicitly if meant, or the trainer silently runs in float32")
        return out

def mismatch_metrics(mu_logp, pi_logp, mask):
    """The engine's (mu) and the trainer's (pi) log-prob of each sampled token, same weights,
    before the update; mask: 1 on response tokens; all (N, T). With d = log mu - log pi and
    r = pi / mu = exp(-d), means over response tokens:
      k1                 mean(d)              KL(mu || pi), signed: errors cancel
      k3                 mean(r - 1 - log r)  KL(mu || pi), each term >= 0: the one to watch
      prob_abs_mean/max  mean/max |mu - pi|   in probability
      logp_abs_mean      mean |d|             the per-token log-ratio
      seq_logratio_abs   mean_i |sum_t d_it|  log of a sequence's importance weight
      logp_mean          mean log pi          how sure the policy is of its samples
    In float64 (float32 loses sums of 1e-8s); k3 as expm1(log r) - log r, as oat does."""
    d = (mu_logp.double() - pi_logp.double()) * mask
    m = mask.double()
    n = m.sum().clamp(min=1)
    log_r = -d
    k3 = (torch.expm1(log_r) - log_r) * m
    dp = (mu_logp.double().exp() - pi_logp.double().exp()).abs() * m
    return {"mismatch_k1": (d.sum() / n).item(),
            "mismatch_k3": (k3.sum() / n).item(),
            "mismatch_prob_abs_mean": (dp.sum() / n).item(),
            "mismatch_prob_abs_max": dp.max().item(),
            "mismatch_logp_abs_mean": (d.abs().sum() / n).item(),
            "mismatch_seq_logratio_abs": d.sum(1).abs().mean().item(),
            "logp_mean": (pi_logp.double() * m).sum().item() / n.item(),
            **framework_metrics(mu_logp.float(), pi_logp.float(), mask.float())}

def framework_metrics(mu, pi, m):
    """verl's and TRL's names for the mismatch, computed as they compute it (float32, their
    formulas and means): hold their dashboards against ours (experiments/mismatch.md)."""
    log_ratio, on = (pi - mu) * m, m.bool()  # verl's log(pi_train / pi_rollout)
    k3 = (torch.exp(log_ratio) - log_ratio - 1) * m  # as verl: at 1e-8 it reads float32 rounding
    return {"rollout_corr/k3_kl": (k3.sum() / (m.sum() + 1e-8)).item(),  # verl_F.masked_mean
            "training/rollout_probs_diff_mean": (pi.exp() - mu.exp())[on].abs().mean().item(),
            "sampling/sampling_logp_difference/mean": log_ratio[on].abs().mean().item()}
