"""
experiments/mismatch.py: the mismatch probe. How far the engine's log-probs (mu) sit from the
trainer's (pi) on fixed weights, in every dtype and with every fix, and what each fix costs.

    python experiments/mismatch.py --json figures/probe.json           # every fix, with costs
    python experiments/mismatch.py --quick --init DIR --json F          # a policy: 3 dtypes

On the held-out prompts, --group-size samples each, three tables. own: each engine samples
(timed the second time, after a warm-up) and each trainer mode scores: what a run sees.
self: each engine's decode log-probs of its samples against its prefill of them. paired: the
fp32 engine's samples scored by every engine's prefill and every trainer, each row over the
bf16 row on the same tokens, with a 95 % bootstrap interval. Then each trainer mode's
forward + backward of 512 sequences, timed, and where in the network each 16-bit trainer's
error enters (offline.layer_errors). --quick (a trained policy's cross-probe, growth.py):
the three dtypes, matched and aligned trainers, no costs. Writes figures/probe.json (the
Intel Xeon) and figures/probe-amd.json (the AMD EPYC), which fixes.py reads.
"""
import time

import numpy as np
import torch

from common import finish, machine_line
from instruments import machine
from offline import (ALIGNED, DTYPES, base_parser, heldout_prompts, layer_errors,
                     mismatch_metrics, parse, prefill, sample, setup, trainer_logprobs)

ENGINES = ("fp32", "bf16", "fp16", "bf16+head32", "fp16+head32")
RESAMPLES = 2000  # bootstrap resamples of the sequences, for the paired ratios' intervals
KEYS = ["mismatch_k3", "mismatch_prob_abs_mean", "mismatch_prob_abs_max",
        "mismatch_logp_abs_mean", "mismatch_seq_logratio_abs"]

def trainers_of(eng, quick=False):
    """A dtype's engine: the plain trainers and its aligned one; a fix's: its trainer, fp32."""
    if eng not in DTYPES:
        return (eng, "fp32")
    aligned = (ALIGNED[eng],) if eng in ALIGNED else ()  # fp32 has none
    return (eng, *aligned) if quick else (*DTYPES, *aligned)

def paired_ratio(d_a, d_b, mask, seed=0):
    """mean |d_a| / mean |d_b| over the same tokens, with a 95 % percentile bootstrap interval
    that resamples whole sequences (tokens of one sequence are not independent)."""
    a = (d_a.abs() * mask).sum(1).double().numpy()
    b = (d_b.abs() * mask).sum(1).double().numpy()
    n = mask.sum(1).double().numpy()
    pick = np.random.default_rng(seed).integers(0, len(n), size=(RESAMPLES, len(n)))
    boot = a[pick].sum(1) / b[pick].sum(1)
    ci = [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))]
    return {"ratio": float(a.sum() / b.sum()), "ci95": ci}

def time_fwd_bwd(model, mode, idx, device):  # seconds for one forward + backward
    t0 = time.perf_counter()
    trainer_logprobs(model, mode, idx, device).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0

def costs(model, idx, device):
    """Each side of each fix, forward + backward of 512 sequences: rounds over the modes after
    a warm-up round, so drift hits every mode alike; the median of three."""
    modes = (*ENGINES, "bf16-aligned")
    times = [[time_fwd_bwd(model, tr, idx[:512], device) for tr in modes] for _ in range(4)][1:]
    return {tr: sorted(t[i] for t in times)[1] for i, tr in enumerate(modes)}

def mismatch(args, engine=None):
    """The three tables, the costs and the layer errors (the module docstring)."""
    ckpt, model, device, get_engine = setup(args, engine)
    prompts = heldout_prompts(args)
    rows, self_rows, paired, speed, cost = [], [], [], {}, {}
    fp32_samples = sample(get_engine("fp32"), prompts, args.group_size, args, device)
    engines = DTYPES if args.quick else ENGINES
    with torch.no_grad():
        pis = {tr: trainer_logprobs(model, tr, fp32_samples[1], device)
               for eng in engines for tr in trainers_of(eng, args.quick)}
    for eng in engines:
        llm = get_engine(eng)
        sample(llm, prompts, args.group_size, args, device)  # the warm-up
        samples, idx, mask, mu, seconds = sample(llm, prompts, args.group_size, args, device)
        speed[eng] = mask.sum().item() / seconds
        own = prefill(llm, samples, device)  # its prefill of its own samples
        self_rows.append({"engine": eng, **mismatch_metrics(mu, own, mask)})
        with torch.no_grad():
            for tr in trainers_of(eng, args.quick):
                pi = trainer_logprobs(model, tr, idx, device)
                rows.append({"engine": eng, "trainer": tr, **mismatch_metrics(mu, pi, mask)})
        mu_common = prefill(llm, fp32_samples[0], device)
        for tr in trainers_of(eng, args.quick):
            metrics = mismatch_metrics(mu_common, pis[tr], fp32_samples[2])
            paired.append({"engine": eng, "trainer": tr, "d": mu_common - pis[tr], **metrics})
        if eng == "bf16" and not args.quick:
            cost = costs(model, idx, device)
    base = next(r["d"] for r in paired if (r["engine"], r["trainer"]) == ("bf16", "bf16"))
    for r in paired:
        r["over_bf16"] = paired_ratio(r.pop("d"), base, fp32_samples[2])
    tables = rows, self_rows, paired, speed, cost
    return result_of(args, ckpt, model, device, fp32_samples, *tables)

def result_of(args, ckpt, model, device, fp32_samples, rows, self_rows, paired, speed,
              cost):
    matched = {r["engine"]: r for r in rows if r["engine"] == r["trainer"]}
    # k1 is signed (its errors cancel), so a ratio of it means nothing; the rest are >= 0
    ratio = {k: matched["bf16"][k] / matched["fp16"][k] for k in matched["fp16"]
             if k.startswith("mismatch_") and k != "mismatch_k1"}
    modes = ("bf16", "fp16", "bf16-aligned", "fp16-aligned")
    layers = layer_errors(model, modes, fp32_samples[1], fp32_samples[2], device)
    result = {"experiment": "mismatch", "checkpoint": ckpt, "seed": args.seed,
              "machine": machine(), "layers": layers,
              "sequences_per_engine": len(fp32_samples[0]),
              "tokens_per_engine": int(fp32_samples[2].sum()),
              "rows": rows, "self_rows": self_rows, "paired_rows": paired,
              "bf16_over_fp16": ratio, "engine_tokens_per_s": speed, "trainer_fwd_bwd_s": cost}
    print_mismatch(result)
    return result

def print_rows(rows, width):
    for r in rows:
        who = f"{r['engine']:{width}}"
        if "trainer" in r:
            who = f"{r['engine']:12} {r['trainer']:14}"
        tail = ""
        if "over_bf16" in r:
            o = r["over_bf16"]
            tail = f" {o['ratio']:>7.3f} [{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}]"
        print(f"{who} " + " ".join(f"{r[k]:>17.3e}" for k in KEYS) + tail)

def print_mismatch(result):
    head = " ".join(f"{k[9:]:>17}" for k in KEYS)
    print(f"\nmismatch between engine (mu) and trainer (pi) on {result['checkpoint']}, "
          f"{result['sequences_per_engine']} responses per engine\n"
          f"{machine_line(result['machine'])}\n\nown samples (what a run sees)\n"
          f"{'engine':12} {'trainer':14} {head}")
    print_rows(result["rows"], 27)
    ratio = result["bf16_over_fp16"]
    print(f"{'bf16 / fp16, matched':27} " + " ".join(f"{ratio[k]:>17.1f}" for k in KEYS))
    print(f"\nthe engine against itself: decode (KV cache) vs prefill of the same tokens\n"
          f"{'engine':27} {head}")
    print_rows(result["self_rows"], 27)
    print(f"\npaired: the fp32 engine's {result['tokens_per_engine']} tokens, every engine's "
          "prefill against every trainer; mean |d| over the bf16 row's [95 % bootstrap]\n"
          f"{'engine':12} {'trainer':14} {head} {'over bf16':>24}")
    print_rows(result["paired_rows"], 27)
    blocks = len(result["layers"]["bf16"]) - 2
    print("\nwhere the error enters: RMS of (mode - fp32) over RMS of fp32\n"
          f"{'mode':14} " + " ".join(f"{f'block {i}':>9}" for i in range(blocks))
          + f" {'norm':>9} {'logits':>9}")
    for mode, errs in result["layers"].items():
        print(f"{mode:14} " + " ".join(f"{e:>9.2e}" for e in errs))
    print_costs(result["engine_tokens_per_s"], result["trainer_fwd_bwd_s"])

def print_costs(speed, cost):
    if not cost:
        return
    print("\nthe cost (against bf16): engine sampling, tokens/s; trainer forward + backward "
          "of 512 sequences, s")
    for eng in (*ENGINES, "bf16-aligned"):
        s = " " * 20
        if eng in speed:
            s = f"engine {speed[eng]:>6.0f} {speed[eng] / speed['bf16']:5.2f}x"
        print(f"{eng:12} {s} | trainer {cost[eng]:5.2f} {cost[eng] / cost['bf16']:5.2f}x")

def main(argv=None, engine=None):
    p = base_parser("the mismatch probe: every dtype and fix on fixed weights (the docstring)")
    p.add_argument("--quick", action="store_true",
                   help="fp32, bf16, fp16 only, no costs (a trained policy)")
    args = parse(p, argv)
    return finish(args, mismatch(args, engine))

if __name__ == "__main__":
    main()
