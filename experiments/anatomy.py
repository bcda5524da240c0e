"""
experiments/anatomy.py: the anatomy of the log-prob mismatch, on identical tokens. Is the
engine's bf16 error noise, or a bias, and of which kind?

    python experiments/anatomy.py --json results/MACHINE/anatomy.json       # the warm start
    python experiments/anatomy.py --init DIR --json F                         # a run's policy
    python experiments/anatomy.py --along F1 F2 ...                # those policies, one table

The fp32 engine samples --group-size responses to each held-out prompt from fixed weights;
every engine variant scores those same tokens by prefill (mu), and the trainer in the same
dtype scores them (pi). With d = log mu - log pi a token, per variant:
  by bucket of pi   the signed mean of d, a 95 % t interval over sequences (each sequence's
                    tokens in the bucket averaged first: tokens of a sequence are not independent)
  temperature       the first-order fit d = (tau - 1) h, h = E_pi[z] - z_y (z: the float32
                    trainer's logits): tau > 1, the engine flatter than the trainer
  along a sequence  the correlation of d at neighbouring positions
  GSPO's window     each sequence's first-update log-ratio, mean_t (log pi - log mu), against
                    GSPO's clip [log(1 - 3e-4), log(1 + 4e-4)]: the share outside as measured,
                    with the bias (the mean over sequences) removed, and the bias alone
The variants: bf16 and fp16, each on the kernels vLLM's loader picked for this chip (the
library's own rounding: rounding.py), or with --library on that library's, forced as plan
rounding's -trunc runs force it: one library a process, so one run per library, on the same
tokens (the fp32 engine's; their digest in the result says so). --hide-amx: the chip's own
library without AMX (plan rounding's bf16-noamx); --site-rounding MODE: the bf16 trainer rounds
the rotary's and the attention's outputs in MODE (sites.py; the matched-size check, sites.md).
Page: anatomy.md.
"""
import hashlib
import math

import numpy as np
import torch

import common
import rounding
from common import PI_EDGES, t_quantile
from grpo import GSPO_CLIP
from instruments import buckets, machine
from offline import (base_parser, heldout_prompts, install_kernels, kernel_flags, parse,
                     prefill, sample, setup, trainer_logprobs)

# The rotary embedding on torch (custom_ops "-rotary_embedding") is not a variant here: vLLM
# caches the first engine's compilation config for the whole process, so that engine needs a
# process of its own, and the same tokens would have to come from a file.
VARIANTS = ("bf16", "fp16")  # each on the kernels vLLM's loader picked for this chip
FOLDS = 16  # the jackknife's groups of sequences, for tau's and the length test's intervals

def by_bucket(d, pi, mask):
    """The signed mean of d per bucket of pi, with a t interval over sequences."""
    rows = []
    for lo, hi, inside in buckets(pi, mask):
        per_seq = [d[i][inside[i]].mean().item() for i in range(len(d)) if inside[i].any()]
        m, se = common.mean_se(per_seq) if len(per_seq) > 1 else (None, None)
        half = t_quantile(len(per_seq) - 1) * se if se else None
        rows.append({"pi": [lo, hi], "tokens": int(inside.sum()), "sequences": len(per_seq),
                     "mean": m, "ci95": [m - half, m + half] if half else None})
    return rows

def surprise_gap(logits, idx):
    """h = E_p[z] - z_y a token, from the float32 trainer's logits z: d's first-order
    response to a logit temperature (float64: a difference of large sums)."""
    z = logits.double()
    return (torch.softmax(z, -1) * z).sum(-1) - torch.gather(z, -1, idx[:, 1:, None]).squeeze(-1)

def temperature(d, logits, idx, mask):  # tau from the float32 trainer's logits
    return fit_temperature(d, surprise_gap(logits, idx), mask)

def fit_temperature(d, h, mask):
    """tau from d = (tau - 1) h, least squares over response tokens, with a 95 % jackknife
    interval over FOLDS groups of sequences."""
    dh, hh = ((d.double() * h * mask).sum(1), (h * h * mask).sum(1))  # per sequence

    def fit(keep):
        return 1.0 + float(dh[keep].sum() / hh[keep].sum())
    tau, ci95 = jackknife(fit, len(d))
    return {"tau": tau, "ci95": ci95}

def jackknife(stat, n):
    """stat(keep) over all n sequences, and its 95 % jackknife interval: FOLDS groups
    (sequence i in group i % FOLDS), each left out in turn."""
    folds = torch.arange(n) % FOLDS
    leave = np.array([stat(folds != f) for f in range(FOLDS)])
    se = math.sqrt((FOLDS - 1) / FOLDS * ((leave - leave.mean()) ** 2).sum())
    x, half = stat(torch.ones(n, dtype=torch.bool)), t_quantile(FOLDS - 1) * se
    return x, [x - half, x + half]

def lag1(d, mask):
    """The correlation of d at neighbouring response positions, over every pair."""
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    a, b = d[:, :-1][both].double().numpy(), d[:, 1:][both].double().numpy()
    return float(np.corrcoef(a, b)[0, 1])

def length_test(d, mask):
    """The variance of the sequences' means of d over what i.i.d. tokens would give: each
    sequence's own token variance over its length, averaged (so sequences of unequal length
    and spread are each predicted by their own), with a 95 % jackknife interval over
    FOLDS groups of sequences. Sequences of one token have no spread: left out."""
    n = mask.sum(1).double()
    keep = n >= 2
    d, m, n = d[keep].double(), mask[keep].double(), n[keep]
    mean = (d * m).sum(1) / n
    own = ((d - mean[:, None]) ** 2 * m).sum(1) / (n - 1)  # ddof 1, about its own mean
    iid = own / n  # var(mean of n i.i.d. tokens) = sigma^2 / n, for this sequence

    def ratio(keep):
        return float(mean[keep].var() / iid[keep].mean())
    r, ci95 = jackknife(ratio, len(mean))
    return {"sequences": len(mean), "seq_mean_var": mean.var().item(),
            "iid_var": iid.mean().item(), "ratio": r, "ci95": ci95}

def window(d, mask, clip=GSPO_CLIP):
    """GSPO's first-update log-ratio per sequence against its clip: the share outside."""
    lo, hi = math.log(1 - clip[0]), math.log(1 + clip[1])
    m = (-(d * mask).sum(1) / mask.sum(1)).double()  # mean_t (log pi - log mu)
    bias = m.mean().item()

    def outside(x):
        return ((x < lo) | (x > hi)).double().mean().item()
    return {"seq_logratio_mean": bias, "seq_logratio_sd": m.std().item(),
            "outside": outside(m), "outside_noise_alone": outside(m - bias),
            "outside_bias_alone": float(not lo <= bias <= hi)}

def anatomy(args, engine=None):
    """Every variant's figures on the fp32 engine's samples (the module docstring)."""
    library = install_kernels(args)  # before any engine: one configuration a process
    ckpt, model, device, get_engine = setup(args, engine)
    prompts = heldout_prompts(args)
    samples, idx, mask, _, _ = sample(get_engine("fp32"), prompts, args.group_size, args, device)
    digest = hashlib.sha1(idx.numpy().tobytes()).hexdigest()[:12]  # the tokens, by library
    with torch.no_grad():
        logits = model(idx[:, :-1]).float()  # the float32 trainer: the temperature's z
    rows = {}
    for name in VARIANTS:
        mu = prefill(get_engine(name), samples, device)
        with torch.no_grad():
            pi = trainer_logprobs(model, name, idx, device)
        d = (mu - pi) * mask
        n = mask.sum()
        rows[name] = {"logp_abs_mean": (d.abs().sum() / n).item(),
                      "signed_mean": (d.sum() / n).item(),
                      "by_pi": by_bucket(d, pi.exp(), mask),
                      "tau": temperature(d, logits, idx, mask),
                      "lag1_correlation": lag1(d, mask), "gspo_window": window(d, mask)}
    result = {"experiment": "anatomy", "checkpoint": ckpt, "machine": machine(),
              "kernel_library": library, "amx_hidden": args.hide_amx,
              "site_rounding": args.site_rounding, "sequences": len(samples),
              "tokens": int(mask.sum()), "tokens_sha1": digest, "variants": rows}
    print_anatomy(result)
    return result

def print_anatomy(result):
    print(f"\nthe mismatch on identical tokens ({result['sequences']} sequences, "
          f"{result['tokens']} tokens, sha1 {result.get('tokens_sha1')}) of "
          f"{result['checkpoint']}, library {result.get('kernel_library')}\n"
          f"{common.machine_line(result['machine'])}\n")
    print("| engine | mean \\|d\\| | signed mean d | tau [95 % CI] | lag-1 correlation | "
          "sequence log-ratio: mean, sd | outside GSPO's clip: measured, noise alone, bias alone |")
    print("|---|---|---|---|---|---|---|")
    for name, r in result["variants"].items():
        w = r["gspo_window"]
        ratio = f"{w['seq_logratio_mean']:+.2e}, {w['seq_logratio_sd']:.2e}"
        print(f"| {name} | " + " | ".join(cells(r, ratio)) + " |")
    heads = [f"pi in [{lo}, {hi})" for lo, hi in zip(PI_EDGES[:-1], PI_EDGES[1:])]
    print("\nsigned mean d by bucket of pi [95 % CI over sequences] (tokens)\n\n| engine | "
          + " | ".join(heads) + " |\n|---|" + "---|" * len(heads))
    for name, r in result["variants"].items():
        by_pi = [f"{b['mean']:+.2e} [{b['ci95'][0]:+.2e}, {b['ci95'][1]:+.2e}] ({b['tokens']})"
                 if b["ci95"] else "-" for b in r["by_pi"]]
        print(f"| {name} | " + " | ".join(by_pi) + " |")

def cells(r, *between):
    """One variant's cells: mean |d|, signed mean, tau, lag-1, then `between`, then the
    shares outside GSPO's clip (the anatomy's table and --along's)."""
    w, t = r["gspo_window"], r["tau"]
    return [f"{r['logp_abs_mean']:.3e}", f"{r['signed_mean']:+.3e}",
            f"{t['tau']:.5f} [{t['ci95'][0]:.5f}, {t['ci95'][1]:.5f}]",
            f"{r['lag1_correlation']:+.3f}", *between,
            f"{w['outside']:.3f}, {w['outside_noise_alone']:.3f}, {w['outside_bias_alone']:.0f}"]

def print_along(paths):
    """One row per result (a run's policy at a step): bf16's figures, and fp16's mean |d|."""
    print("| policy | bf16 mean \\|d\\| | signed mean d | tau [95 % CI] | lag-1 | "
          "outside GSPO's clip: measured, noise alone, bias alone | fp16 mean \\|d\\| |")
    print("|---|---|---|---|---|---|---|")
    for path in paths:
        r = common.load_json(path, "anatomy.py --init DIR --json F")
        fp16 = r["variants"]["fp16"]["logp_abs_mean"]
        lib = r.get("kernel_library")  # absent in results from before --library
        policy = f"{r['checkpoint']} ({lib})" if lib else r["checkpoint"]
        row = [policy, *cells(r["variants"]["bf16"]), f"{fp16:.3e}"]
        print("| " + " | ".join(row) + " |")

def main(argv=None, engine=None):
    p = base_parser("the anatomy of the mismatch on identical tokens (the docstring)")
    p.add_argument("--along", nargs="+", default=None,
                   help="print these results' table (a run's policies), measure nothing")
    kernel_flags(p)
    args = parse(p, argv)
    rounding.refuse_unrunnable(args.library, args.hide_amx)
    if args.along:
        return print_along(args.along)
    return common.finish(args, anatomy(args, engine))

if __name__ == "__main__":
    main()
