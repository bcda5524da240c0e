"""
experiments/offline.py: what the offline experiments share. No training: fixed weights (the
warm start, or --init DIR, e.g. a finished run's hf/), the real engine in each way of
computing, the trainer beside it. mismatch.py, scaler.py, audit.py, heldout.py and
trainer_half.py each run one experiment on top of it.

A way of computing (a "mode") is one record of MODES: a dtype, the LM head's dtype
(--lm-head) and the trainer's kernels (--trainer-kernels). Its name says the same, a dtype,
"+head32" for the fp32 LM head, "-aligned" for the trainer on the engine's kernels, but no code
reads the name: add a mode with one line there. Every result records the machine: the 16-bit
numbers are the chip's.
"""
import argparse
import time

import torch

import common
import rounding
import sites
import task
from common import at_least, parser
from instruments import pi_buckets, prefill_logprobs
from model import hf_named_tensors, load_hf, pack, read_config, token_logprobs
from precision import get_precision
from precision import mismatch_metrics as basic_metrics
from rollout import generate, start_engine, sync_weights
from warm_start import model_config, warm_start

DTYPES = ("fp32", "bf16", "fp16")
MODES = {  # mode: (dtype, LM head, trainer kernels), get_precision's arguments
    **{dtype: (dtype, "same", "torch") for dtype in DTYPES},
    "bf16+head32": ("bf16", "fp32", "torch"),  # the fix that keeps the LM head in float32
    "fp16+head32": ("fp16", "fp32", "torch"),
    "bf16-aligned": ("bf16", "same", "engine"),  # the trainer on the engine's kernels
    "fp16-aligned": ("fp16", "same", "engine"),
}
# each dtype's trainer on its engine's kernels, read off MODES
ALIGNED = {dtype: mode for mode, (dtype, head, kernels) in MODES.items()
           if kernels == "engine" and head == "same"}

def mismatch_metrics(mu_logp, pi_logp, mask):
    """The run's mismatch metrics and, per bucket of pi, the share of tokens and their mismatch."""
    return {**basic_metrics(mu_logp, pi_logp, mask), **pi_buckets(mu_logp, pi_logp, mask)}

def precision_of(mode, device):
    dtype, head, kernels = MODES[mode]
    return get_precision(dtype, lm_head=head, device=device, kernels=kernels)

def trainer_logprobs(model, mode, idx, device):
    return token_logprobs(precision_of(mode, device).logits_fn(model), idx)

def setup(args, engine=None):
    """The weights, and mode -> an engine serving them (`engine`: the tests' shared engines).
    Every engine stays referenced to the end: destroying an in-process vLLM engine tears down
    process-wide state the others still use."""
    device = get_precision("fp32").device
    cfg = model_config(args.n_items, args.max_new_tokens)
    ckpt = args.init or warm_start(cfg, args.n_items, args.seed, device)
    model, engines = load_hf(ckpt, device).eval(), {}

    def get_engine(mode):
        prec = precision_of(mode, device)
        if mode not in engines and engine:
            engines[mode] = engine(prec.vllm_dtype, prec.head_fp32)
        elif mode not in engines:
            engines[mode] = start_engine(
                ckpt, prec.vllm_dtype, args.seed, cfg.max_seq_len, prec.head_fp32)
        sync_weights(engines[mode], hf_named_tensors(model), prec.engine_dtype)
        return engines[mode]
    return ckpt, model, device, get_engine

def heldout_prompts(args):
    problems = task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    return [task.prompt_ids(p) for p, _ in problems]

def sample(llm, prompts, n, args, device):
    """(samples, idx, mask, mu, seconds): the same random numbers for every engine."""
    torch.manual_seed(task.seed_of("probe", args.seed))  # the global generator
    t0 = time.perf_counter()
    samples = generate(llm, prompts, n, args.max_new_tokens, task.EOS_ID)
    seconds = time.perf_counter() - t0
    columns = [[getattr(s, k) for s in samples] for k in ("prompt_ids", "response_ids")]
    idx, mask, mu = pack(*columns, device, [s.logprobs for s in samples])
    return samples, idx, mask, mu, seconds

def prefill(llm, samples, device):
    """The engine's prefill log-probs of the samples' response tokens, laid out as pack lays
    out mu."""
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    lps = prefill_logprobs(llm, sequences, [len(s.prompt_ids) for s in samples])
    columns = [[getattr(s, k) for s in samples] for k in ("prompt_ids", "response_ids")]
    return pack(*columns, device, lps)[2]

def activations(model, mode, idx, device):
    """A mode's forward on idx, as float32 copies: the residual stream after each block, the
    final norm's output and the logits (hooks; the aligned modes fire them too: aligned.py)."""
    seen, layers = [], (*model.layers, model.norm)
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.float())) for m in layers]
    forward = model if mode == "fp32" else precision_of(mode, device).logits_fn(model)
    with torch.no_grad():
        seen.append(forward(idx[:, :-1]).float())
    [h.remove() for h in hooks]
    return seen

def relative(acts, ref, mask, scale=None):
    """RMS of acts - ref over RMS of scale (by default ref), each layer, response positions; in
    double, since differences of 1e-3 of the value are the subject."""
    def rms(x):
        return x[mask.bool()].double().pow(2).mean().sqrt().item()

    return [rms(a - r) / rms(s) for a, r, s in zip(acts, ref, scale or ref)]

def layer_errors(model, modes, idx, mask, device):
    """Where a trainer mode's error enters: its residual stream after each block, the final
    norm's output and the logits against the float32 forward's on the same tokens, as RMS of the
    difference over RMS of the float32 value (response positions). The aligned modes compute
    what the engine computes: the engine's own error, layer by layer."""
    ref = activations(model, "fp32", idx, device)
    return {mode: relative(activations(model, mode, idx, device), ref, mask) for mode in modes}

def flat_grad(model, loss):
    """The gradient of `loss` in the float32 master weights, as one vector."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return torch.cat([g.flatten() for g in grads])

def underflow(g, exact):
    """Of the entries non-zero in float32: the share stored as 0, and as 0 or a subnormal."""
    n, on = max(1, (exact != 0).sum().item()), exact != 0
    tiny = g.abs() < torch.finfo(g.dtype).tiny
    return ((g == 0) & on).sum().item() / n, (tiny & on).sum().item() / n

def rl_args(args):
    """The flags train_grpo.rollout reads, its seed --rl-seed: a run's batches, step by step."""
    return argparse.Namespace(**{**vars(args), "seed": args.rl_seed})

def base_parser(description):
    """The flags every offline experiment takes."""
    p = parser(description)
    p.add_argument("--init", default=None, help="a checkpoint (default: the warm start)")
    p.add_argument("--seed", type=int, default=0, help="the task's splits, warm start, sampling")
    p.add_argument("--n-items", type=at_least(1), default=12, help="digits to sort: 2n tokens")
    p.add_argument("--group-size", type=at_least(2), default=8, help="samples per prompt")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p

def parse(p, argv):
    """The flags, checked: one line and exit 2 before any work."""
    args = p.parse_args(argv)
    args.max_new_tokens, args.dr_grpo = 2 * args.n_items + 8, False
    refuse_bad_init(args.init)
    common.writable(args.json)
    return args

def refuse_bad_init(path):
    """--init, where given: model.read_config's check, one line and exit 2 before any work."""
    try:
        read_config(path) if path else None
    except ValueError as e:
        common.refuse(f"--init: {e}")

def kernel_flags(p):
    """The engine's kernel library and the bf16 trainer's rounding at the two sites: one of
    each a process, so each experiment that takes them runs once per configuration."""
    p.add_argument("--library", choices=list(rounding.LIBRARIES), default=None,
                   help="vLLM's kernels from this library (default: the one vLLM picks)")
    p.add_argument("--hide-amx", action="store_true", help="the library's kernels without AMX")
    p.add_argument("--site-rounding", default="rne", choices=sites.MODES,
                   help="the bf16 trainer's rounding at the rotary and attention (sites.py)")

def install_kernels(args):
    """Before any engine starts: vLLM's library (rounding.load; it returns the one loaded)
    and the trainer's site rounding (sites.install; rne: the trainer as it is)."""
    library = rounding.load(args.library, amx=not args.hide_amx)
    if args.site_rounding != "rne":
        sites.install(args.site_rounding)
    return library
