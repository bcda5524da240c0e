"""
experiments/meter.py: the mismatch meter, for any Hugging Face model. Is my engine's
mismatch biased, and where does it come from?

    python experiments/meter.py MODEL_DIR --dtype bf16 --json meter.json
    python experiments/meter.py MODEL_DIR --prompts my.jsonl --samples 4 --clip 0.2 0.28

MODEL_DIR is a local folder that vLLM serves and transformers loads. The prompts: a .txt file
(a prompt a line), a .jsonl file ({"prompt": text} or {"prompt_ids": [ids]} a line), or a set
built in: "text" (PROMPTS, needs the model's tokenizer) or "sorting" (this project's held-out
prompts, as token ids: its export has no tokenizer). On identical tokens:
  1. the float32 engine samples --samples responses to each prompt, temperature 1;
  2. the engine in --dtype scores those tokens by prefill (mu), and the trainer in --dtype
     scores them (pi): transformers, or --trainer project (this project's model.py, as its
     runs train it);
  3. with d = log mu - log pi a token: mean |d|, the signed mean with a 95 % t interval over
     sequences, by bucket of pi, the temperature fit, the lag-1 correlation, the length
     test (below; anatomy.py's functions), the shares outside the clip window;
  4. the same tokens under the names dashboards show, computed as verl, TRL and NeMo RL do;
  5. where the trainer's own error enters: each layer's output in --dtype against float32
     (RMS of the difference over RMS), and the first layer past --layer-threshold;
  6. the vLLM kernel library this process loaded and its float32 -> 16-bit rounding at each
     op (rounding.py's probe; vLLM's CPU kernels only);
  7. one line of verdict.
The length test: the variance of the sequences' means of d over what i.i.d. tokens would give
(each sequence's own token variance / its length). Near 1 the error averages out along a
sequence; above 1 it does not (a per-sequence offset, or errors correlated along it).
Refuses, one line and exit 2, before any work: a folder that is not a model, an architecture
vLLM or transformers cannot load, a dtype this machine's vLLM cannot run, prompts longer than
the context, a clip window that is not a window. On a GPU the same calls run (the op probe is
skipped: it reads vLLM's CPU kernels); that path is not verified here. Page: meter.md.
"""
import hashlib
import json
import os

import torch

import anatomy
import common
import rounding
import task
from grpo import GSPO_CLIP
from instruments import machine, prefill_logprobs
from model import logprobs_of, pack
from precision import framework_metrics
from rollout import generate, start_engine, sync_weights

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Where the verdict calls an engine's conversion rounding or truncating: the share of the
# probe's outputs equal to the truncated float32 (rounding gives about a half there).
TRUNCATES = 0.99
CHUNK = 8  # sequences a trainer forward: bounds the float32 logits' memory
# The first layer "past the threshold": its error over LAYER_UNITS units of the dtype's
# roundoff (2^-9 for bf16, 2^-12 for fp16), unless --layer-threshold says.
LAYER_UNITS = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STARTED = []  # a destroyed in-process engine tears down vLLM's process-wide state
PROMPTS = [  # the built-in text prompts: short, varied, English
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The derivative of x squared is", "To make a cup of tea, first",
    "The three laws of motion are", "import numpy as np\n\ndef", "Dear hiring manager,",
    "Water boils at", "The main causes of the First World War were",
    "In machine learning, overfitting means", "Q: What is 17 times 3?\nA:",
]

def refuse_bad_model(folder):
    """One line and exit 2 unless vLLM and transformers can both load this folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        common.refuse(f"{folder}: not a Hugging Face model folder (no config.json)")
    archs = json.load(open(path)).get("architectures") or ["(none)"]
    import transformers
    from vllm.model_executor.models import ModelRegistry
    missing = [a for a in archs if a not in ModelRegistry.get_supported_archs()]
    missing += [a for a in archs if not hasattr(transformers, a)]
    if missing:
        common.refuse(f"{folder}: vLLM or transformers cannot load architecture {missing[0]}")

def refuse_bad_dtype(dtype):
    from vllm.platforms import current_platform
    if DTYPES[dtype] not in current_platform.supported_dtypes:
        common.refuse(f"--dtype {dtype}: this machine's vLLM cannot run it")

def read_prompts(args):
    """Token-id prompts from --prompts (a file or a built-in set), or a refusal."""
    if args.prompts == "sorting":
        problems = task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
        return [task.prompt_ids(p) for p, _ in problems]
    if args.prompts == "text":
        rows = [{"prompt": p} for p in PROMPTS]
    elif not os.path.isfile(args.prompts):
        common.refuse(f"--prompts {args.prompts}: no such file (or text, sorting)")
    elif args.prompts.endswith(".jsonl"):
        try:
            rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
        except ValueError as e:
            common.refuse(f"--prompts {args.prompts}: not JSON lines ({e})")
    else:
        rows = [{"prompt": line.rstrip("\n")} for line in open(args.prompts) if line.strip()]
    if not rows or not all("prompt_ids" in r or "prompt" in r for r in rows):
        common.refuse(f"--prompts {args.prompts}: no prompts, or one with no prompt(_ids)")
    if all("prompt_ids" in r for r in rows):
        return [list(r["prompt_ids"]) for r in rows]
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):
        common.refuse(f"{args.model}: no tokenizer: give --prompts a .jsonl of prompt_ids")
    return [tok(r["prompt"])["input_ids"] for r in rows]

def refuse_long(prompts, config, max_new_tokens):
    context = config.get("max_position_embeddings")
    longest = max(len(p) for p in prompts)
    if context and longest + max_new_tokens + 1 > context:  # prefill asks one token more
        common.refuse(f"--prompts: {longest} tokens + --max-new-tokens {max_new_tokens} + 1 "
                      f"exceed the model's context, {context}")
    if not longest:
        common.refuse("--prompts: an empty prompt")

def library_rounding(library):
    """The kernel library this process loads (`library` forced), and its rounding at the
    model's ops: the op probe's shares equal to round-to-nearest and to truncation."""
    if DEVICE == "cuda":  # the probe reads vLLM's CPU kernels
        return None
    result = rounding.probe(library)
    ops = {name: {dt: {k: row[dt][k] for k in ("match_nearest", "match_truncation")
                       if k in row[dt]} for dt in ("bf16", "fp16") if dt in row}
           for name, row in result["ops"].items() if row["on_model_path"]}
    return {"library": result["library"], "attention_isa": result["attention_isa"],
            "ops": ops}

def truncating_ops(fingerprint, dtype):
    if not fingerprint or dtype != "bf16":
        return []
    return [name for name, row in fingerprint["ops"].items()
            if row["bf16"].get("match_truncation", 0) >= TRUNCATES]

def hf_trainer(folder, dtype):
    """forward(idx, low) -> (float32 logits, [(name, hidden state)]): transformers' model
    in the dtype (low) or in float32. Its hidden states: the embeddings, each layer's
    output (the last after the final norm, as transformers returns them)."""
    from transformers import AutoModelForCausalLM
    models = {low: AutoModelForCausalLM.from_pretrained(folder, dtype=dt).to(DEVICE).eval()
              for low, dt in ((False, torch.float32), (True, DTYPES[dtype]))}

    def forward(idx, low):
        out = models[low](idx, output_hidden_states=True)
        last = len(out.hidden_states) - 1  # transformers applies the final norm to it
        names = ["embeddings", *(f"layer {i}" for i in range(1, last)), f"layer {last} + norm"]
        return out.logits.float(), list(zip(names, out.hidden_states))
    return forward

def project_trainer(folder, dtype):
    """The same for this project's model.py, as its runs train: float32 master weights,
    the forward in the dtype (precision.py). Hidden states: each block's, the final norm's."""
    from model import load_hf
    from offline import precision_of
    model = load_hf(folder, DEVICE).eval()
    low = precision_of(dtype, DEVICE).logits_fn(model)
    layers = [*model.layers, model.norm]
    names = [f"layer {i}" for i in range(1, len(model.layers) + 1)] + ["final norm"]

    def forward(idx, is_low):
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o)) for m in layers]
        logits = (low if is_low else model)(idx)
        [h.remove() for h in hooks]
        return logits.float(), list(zip(names, seen))
    return forward

def score(forward, idx, mask, chunk):
    """pi (the trainer's log-probs in the dtype), h (anatomy.surprise_gap, from the float32
    logits) and each layer's error, RMS(dtype - float32) / RMS(float32) over the response
    positions (offline.layer_errors' measure), a chunk of sequences at a time."""
    pis, hs, sums = [], [], {}
    for s in range(0, len(idx), chunk):
        x, on = idx[s:s + chunk].to(DEVICE), mask[s:s + chunk].bool().to(DEVICE)
        with torch.no_grad():
            low, low_hidden = forward(x[:, :-1], True)
            ref, ref_hidden = forward(x[:, :-1], False)
        pis.append(logprobs_of(low, x).cpu())
        hs.append(anatomy.surprise_gap(ref, x).cpu())
        pairs = zip([*low_hidden, ("logits", low)], [*ref_hidden, ("logits", ref)])
        for (name, a), (_, r) in pairs:  # float64 sums: a ratio of 1e-3s over many values
            err, size = sums.get(name, (0.0, 0.0))
            r = r.float()[on].double()
            sums[name] = (err + (a.float()[on].double() - r).pow(2).sum().item(),
                          size + r.pow(2).sum().item())
    layers = [{"layer": k, "rel_error": (e / n) ** 0.5} for k, (e, n) in sums.items()]
    return torch.cat(pis), torch.cat(hs), layers

def signed_over_sequences(d, mask):
    """The signed mean of d: each sequence's mean first (its tokens are not independent),
    then a 95 % t interval over sequences."""
    per_seq = ((d * mask).sum(1) / mask.sum(1)).tolist()
    m, se = common.mean_se(per_seq)
    half = common.t_quantile(len(per_seq) - 1) * se
    return {"mean": m, "ci95": [m - half, m + half]}

def dashboards(mu, pi, mask):
    """The same tokens under the names dashboards show, computed as each framework does."""
    m = mask.float()
    theirs = framework_metrics(mu.float(), pi.float(), m)  # verl's and TRL's, precision.py
    log_r = (pi - mu).float()  # NeMo RL's calculate_kl: logr = prev - generation, then k3
    nemo = {"train/gen_kl_error": (torch.exp(log_r) - 1 - log_r) * m,  # float32, as theirs
            "train/token_mult_prob_error": torch.exp((mu - pi).abs() * m) * m}
    nemo = {k: (v.sum() / (m.sum() + 1e-8)).item() for k, v in nemo.items()}  # masked_mean
    return {"verl": {k: v for k, v in theirs.items() if not k.startswith("sampling/")},
            "trl": {k: v for k, v in theirs.items() if k.startswith("sampling/")},
            "nemo_rl": nemo}

def first_past(layers, threshold):
    return next((r["layer"] for r in layers if r["rel_error"] > threshold), None)

def clip_shares(d, mask, clip):
    """Outside the ratio window [1 - lo, 1 + hi]: the share of tokens (PPO's ratio pi/mu),
    and of sequences (GSPO's, anatomy.window: measured, noise alone, bias alone)."""
    r = torch.exp(-d)[mask.bool()]
    tokens = ((r < 1 - clip[0]) | (r > 1 + clip[1])).double().mean().item()
    return {"clip": list(clip), "tokens_outside": tokens, **anatomy.window(d, mask, clip)}

def engines(args, max_len, engine=None):
    """dtype -> an engine of the model (`engine`: the tests' shared engines, given the
    folder's weights). Every engine stays referenced to the process's end: STARTED."""
    started = {}

    def get(name):
        if name not in started and engine:
            started[name] = engine(VLLM_DTYPE[name])
            from safetensors.torch import load_file
            weights = load_file(os.path.join(args.model, "model.safetensors"))
            sync_weights(started[name], weights.items(), getattr(torch, VLLM_DTYPE[name]))
        elif name not in started:
            started[name] = start_engine(args.model, VLLM_DTYPE[name], args.seed, max_len)
            STARTED.append(started[name])
        return started[name]
    return get

def identical_tokens(get_engine, prompts, args, eos):
    """The float32 engine's samples (idx, mask, the samples) and the engine's prefill
    log-probs of them in the dtype (mu), laid out as model.pack lays them out."""
    torch.manual_seed(task.seed_of("probe", args.seed))  # anatomy.py's: the same tokens
    samples = generate(get_engine("fp32"), prompts, args.samples, args.max_new_tokens, eos)
    samples = [s for s in samples if s.response_ids]  # an instant end token scores nothing
    sequences = [s.prompt_ids + s.response_ids for s in samples]
    lps = prefill_logprobs(get_engine(args.dtype), sequences,
                           [len(s.prompt_ids) for s in samples])
    columns = [[getattr(s, k) for s in samples] for k in ("prompt_ids", "response_ids")]
    return pack(*columns, "cpu", lps, pad=eos)

def measure(args, config, prompts, engine=None):
    """Every figure of the docstring, on identical tokens."""
    fingerprint = library_rounding(args.library)  # before any engine: one library a process
    eos = config.get("eos_token_id")
    eos = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 1  # prefill: one more
    get_engine = engines(args, max_len, engine)
    idx, mask, mu = identical_tokens(get_engine, prompts, args, eos)
    trainer = (project_trainer if args.trainer == "project" else hf_trainer)(args.model,
                                                                          args.dtype)
    pi, h, layers = score(trainer, idx, mask, args.chunk)
    d = (mu - pi) * mask
    n = mask.sum()
    threshold = args.layer_threshold or LAYER_UNITS * torch.finfo(DTYPES[args.dtype]).eps / 2
    return {"experiment": "meter", "model": args.model,
            "architecture": config.get("architectures"), "dtype": args.dtype,
            "trainer": args.trainer, "machine": machine(), "engine_rounding": fingerprint,
            "sequences": len(idx), "tokens": int(n),
            "tokens_sha1": hashlib.sha1(idx.numpy().tobytes()).hexdigest()[:12],
            "logp_abs_mean": (d.abs().sum() / n).item(), "signed_mean": (d.sum() / n).item(),
            "signed_over_sequences": signed_over_sequences(d, mask),
            "by_pi": anatomy.by_bucket(d, pi.exp(), mask),
            "tau": anatomy.fit_temperature(d, h, mask),
            "lag1_correlation": anatomy.lag1(d, mask), "length_test": anatomy.length_test(d, mask),
            "window": clip_shares(d, mask, args.clip), "dashboards": dashboards(mu, pi, mask),
            "layers": layers, "layer_threshold": threshold,
            "first_layer_past": first_past(layers, threshold)}

def verdict(r):
    """One line a practitioner can act on: the engine's rounding first, then the bias."""
    s, size = r["signed_over_sequences"], r["logp_abs_mean"]
    lib = (r["engine_rounding"] or {}).get("library")
    ops = truncating_ops(r["engine_rounding"], r["dtype"])
    if ops:
        return (f"this engine ({lib}) truncates float32 to bf16 at {', '.join(ops)}: a "
                f"one-signed error there (on this project's model, about twice the mismatch "
                f"of a rounding engine, and GSPO runs that fell); experiments/report.md has "
                f"the workaround (the trainer rounding as the engine does, or vLLM patched)")
    biased = s["ci95"][0] > 0 or s["ci95"][1] < 0
    side = "engine above trainer" if s["mean"] > 0 else "engine below trainer"
    tail = (f"biased ({side}: signed mean {s['mean']:+.2e}, {abs(s['mean']) / size:.0%} of "
            f"the mean |d| {size:.2e}, its 95 % interval excludes 0)" if biased else
            f"no bias resolved (signed mean {s['mean']:+.2e}, 95 % interval "
            f"[{s['ci95'][0]:+.2e}, {s['ci95'][1]:+.2e}]): noise of {size:.2e} a token")
    where = f"the engine ({lib}) does not truncate at its probed ops; " if lib else ""
    return where + tail

def print_meter(r):
    w, t, L = r["window"], r["tau"], r["length_test"]
    s = r["signed_over_sequences"]
    print(f"\nthe mismatch meter: {r['model']} ({', '.join(r['architecture'] or [])}), "
          f"{r['dtype']}, trainer {r['trainer']}\n{common.machine_line(r['machine'])}")
    fp = r["engine_rounding"]
    if fp:
        isa = fp["attention_isa"]
        print(f"vLLM kernel library {fp['library']} (attention: {isa['bf16']} in bf16, "
              f"{isa['fp16']} in fp16); its float32 -> 16 bits at the model's ops, the share "
              "equal to nearest / truncated in bf16, to nearest in fp16: " + ", ".join(
                  f"{k} {v['bf16']['match_nearest']:.3f} / "
                  f"{v['bf16'].get('match_truncation', 0):.3f}, {v['fp16']['match_nearest']:.3f}"
                  for k, v in fp["ops"].items()))
    print(f"identical tokens: {r['sequences']} sequences, {r['tokens']} response tokens "
          f"(sha1 {r['tokens_sha1']}), sampled by the float32 engine\n\n"
          "| mean \\|d\\| | signed mean d [95 % CI over sequences] | tau [95 % CI] | lag-1 | "
          "length test: spread / i.i.d. [95 % CI] | outside the clip: tokens; sequences measured, "
          "noise alone, bias alone |\n|---|---|---|---|---|---|")
    print(f"| {r['logp_abs_mean']:.3e} | {s['mean']:+.3e} [{s['ci95'][0]:+.2e}, "
          f"{s['ci95'][1]:+.2e}] | {t['tau']:.5f} [{t['ci95'][0]:.5f}, {t['ci95'][1]:.5f}] | "
          f"{r['lag1_correlation']:+.3f} | {L['ratio']:.2f} [{L['ci95'][0]:.2f}, "
          f"{L['ci95'][1]:.2f}] | {w['tokens_outside']:.3f}; "
          f"{w['outside']:.3f}, {w['outside_noise_alone']:.3f}, "
          f"{w['outside_bias_alone']:.0f} (clip {w['clip'][0]:g}, {w['clip'][1]:g}) |")
    print("\nsigned mean d by bucket of pi [95 % CI over sequences] (tokens): " + "; ".join(
        f"[{b['pi'][0]}, {b['pi'][1]}) {b['mean']:+.2e} [{b['ci95'][0]:+.2e}, "
        f"{b['ci95'][1]:+.2e}] ({b['tokens']})" for b in r["by_pi"] if b["ci95"]))
    print("dashboards: " + "; ".join(f"{fw} {k} {v:.4e}" for fw, keys in
                                     r["dashboards"].items() for k, v in keys.items()))
    print(f"the trainer in {r['dtype']} against float32, RMS error / RMS, per layer: "
          + ", ".join(f"{x['layer']} {x['rel_error']:.2e}" for x in r["layers"])
          + f"; first past {r['layer_threshold']:.2e}: {r['first_layer_past'] or 'none'}")
    print(f"\nverdict: {r['verdict']}")

def clip_window(text):  # an argparse type: one side of a ratio window, in (0, 1)
    x = float(text)
    if not 0 < x < 1:
        raise ValueError(text)
    return x

def get_args(argv):
    p = common.parser("the mismatch meter for a Hugging Face model (the docstring)")
    p.add_argument("model", help="a local Hugging Face model folder")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="the engine's and the trainer's 16-bit type")
    p.add_argument("--prompts", default="text",
                   help="a .txt or .jsonl file, or a built-in set: text, sorting")
    p.add_argument("--samples", type=common.at_least(2), default=8, help="responses a prompt")
    p.add_argument("--max-new-tokens", type=common.at_least(1), default=64)
    p.add_argument("--clip", type=clip_window, nargs=2, default=list(GSPO_CLIP),
                   metavar=("LOW", "HIGH"), help="the ratio window [1 - LOW, 1 + HIGH]")
    p.add_argument("--trainer", choices=("transformers", "project"), default="transformers",
                   help="who scores pi: transformers, or this project's model.py (its export)")
    p.add_argument("--library", choices=list(rounding.LIBRARIES), default=None,
                   help="vLLM's CPU kernels from this library (default: the one vLLM picks)")
    p.add_argument("--layer-threshold", type=float, default=None,
                   help=f"a layer's error to report (default {LAYER_UNITS} units of roundoff)")
    p.add_argument("--seed", type=int, default=0, help="the engine's and the sampling's")
    p.add_argument("--n-items", type=common.at_least(1), default=12,
                   help="the sorting set's digits to sort")
    p.add_argument("--chunk", type=common.at_least(1), default=CHUNK, help="sequences a forward")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)

def checked(args):
    """The model's config and token-id prompts, or a one-line refusal (exit 2)."""
    refuse_bad_model(args.model)
    refuse_bad_dtype(args.dtype)
    if args.library and DEVICE == "cuda":
        common.refuse("--library: vLLM's CPU kernel libraries; this machine runs a GPU")
    rounding.refuse_unrunnable(args.library)
    if args.trainer == "project":
        from model import read_config
        try:
            read_config(args.model)
        except ValueError as e:
            common.refuse(f"--trainer project: {e}")
    config = json.load(open(os.path.join(args.model, "config.json")))
    prompts = read_prompts(args)
    refuse_long(prompts, config, args.max_new_tokens)
    common.writable(args.json)
    return config, prompts

def main(argv=None, engine=None):
    args = get_args(argv)
    config, prompts = checked(args)
    result = measure(args, config, prompts, engine)
    result["verdict"] = verdict(result)
    print_meter(result)
    return common.finish(args, result)

if __name__ == "__main__":
    main()
