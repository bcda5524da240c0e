"""
experiments/growth.py: why the mismatch grows over a run. The same runs as the campaign's,
read through the buckets of pi, and the cross-probe: each seed's bf16- and fp16-trained
policies (and its warm start), each probed in bf16 and in fp16 (mismatch.py --quick).

    AMD=results/amd-epyc-avx2-avx512f-avx512-bf16
    XEON=results/intel-xeon-processor-2-80ghz-avx2-avx512f
    AMX=results/intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16
    python experiments/growth.py $AMD --out figures/growth-amd.png
    python experiments/growth.py $AMD/step8 --out figures/growth-step8-amd.png
    python experiments/growth.py $XEON --out figures/growth.png
    python experiments/growth.py $AMX --arms gspo-engine --seeds 0 1 2 3 4 5 6 7 \
        --variants fp16 bf16 fp32 bf16-head32 bf16-engine32 bf16-aligned \
        --out figures/growth-amx.png

Per arm and variant over the steps: the per-token mismatch, its rise within buckets of pi and
from tokens changing bucket (results.decompose: growth - 1 = within + shift), the entropy, the
RMS of the logits, the response length; the table of results.GROWTH; the cross-probe per seed
and paired; where the error enters per layer. Page: experiments/growth.md.
"""
import math

import numpy as np

from common import paired
from results import (GROWTH, draw, parse_runs, pick, print_table, runs_parser, save,
                     with_variants)

PANELS = [("mismatch_logp_abs_mean", "mean |log mu - log pi|"),
          ("mismatch_within", "its rise within buckets of pi"),
          ("mismatch_shift", "its rise from tokens changing bucket"),
          ("entropy_mean", "entropy of the sampled tokens"),
          ("logit_rms", "RMS of the logits"),
          ("response_len_mean", "response length")]
LAYER_MODES = ("bf16", "bf16-aligned", "fp16", "fp16-aligned")

def print_cross(out):
    """The 2 x 2 cross-probe per seed: the bf16- and fp16-trained policies (and the warm start),
    each probed in bf16 and in fp16; then, paired by seed, how much further the bf16-trained
    policy is from the fp16-trained one in bf16 than in fp16 (a log ratio: > 0 if training in
    bf16 drove the policy to where bf16 rounds worse, 0 if the format only sets the scale)."""
    for arm, cells in out["arms"].items():
        pols = [cells.get(v) for v in ("warm start", "bf16", "fp16")]
        seeds = []
        if all(pols):  # every seed with all three policies probed
            seeds = sorted(set.intersection(*(set(c["seeds"]) for c in pols)))
        keys = ("probe_bf16", "probe_fp16")
        seeds = [s for s in seeds if None not in (pick(c, k, s) for c in pols for k in keys)]
        if not seeds:
            continue
        print(f"\n{arm}, cross-probe per seed: bf16 / fp16 mismatch of each policy, on that "
              "policy's own samples\n\n| seed | warm start | bf16-trained | fp16-trained |\n"
              "|---|---|---|---|")
        for s in seeds:
            each = [f"{pick(c, 'probe_bf16', s):.3e} / {pick(c, 'probe_fp16', s):.3e}"
                    for c in pols]
            print(f"| {s} | " + " | ".join(each) + " |")

        def log_ratio(k):
            return [math.log(pick(pols[1], k, s) / pick(pols[2], k, s)) for s in seeds]

        zero = [0.0] * len(seeds)  # against 0: is the bf16-trained policy further off there
        in_bf16, in_fp16 = log_ratio("probe_bf16"), log_ratio("probe_fp16")
        cells["bf16"].update(cross_bf16=paired(in_bf16, zero), cross_fp16=paired(in_fp16, zero),
                             cross_excess=paired(in_bf16, in_fp16))
        print()
        for key, what in (("cross_bf16", "in bf16"), ("cross_fp16", "in fp16"),
                          ("cross_excess", "in bf16 minus the same in fp16")):
            d = cells["bf16"][key]
            if d["se"] is not None:  # two seeds or more (0 when every seed agrees exactly)
                print(f"log(bf16-trained / fp16-trained) {what}: {d['mean']:+.3f} "
                      f"[{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] p={d['p_sign_flip']:.3f} "
                      f"(n={d['n']})")

def print_layers(out):
    """Where the error enters, mean over the seeds' final policies: RMS(mode - fp32) /
    RMS(fp32) per block, norm, logits (offline.layer_errors)."""
    probed = [(arm, v, [x for x in cell.get("layers") or [] if x])
              for arm, cells in out["arms"].items() for v, cell in cells.items()]
    probed = [(arm, v, layers) for arm, v, layers in probed if layers]
    if not probed:
        return
    blocks = len(probed[0][2][0]["bf16"]) - 2  # the blocks, then the final norm and the logits
    print("\nwhere the error enters (offline.layer_errors), mean over the probed seeds\n\n"
          "| arm | policy | mode | " + " | ".join(f"block {i}" for i in range(blocks))
          + " | norm | logits |\n" + "|---" * (blocks + 5) + "|")
    for arm, v, layers in probed:
        for mode in LAYER_MODES:
            errs = np.mean([x[mode] for x in layers], axis=0)
            print(f"| {arm} | {v} (n={len(layers)}) | {mode} | "
                  + " | ".join(f"{e:.2e}" for e in errs) + " |")

def main(argv=None):
    args = parse_runs(with_variants(runs_parser("why the mismatch grows (the docstring)")), argv)
    fig, table = draw(args.path, args.seeds, args.arms, PANELS, GROWTH, with_warm=True,
                      variants=args.variants)
    print_table(table, GROWTH)
    print_cross(table)
    print_layers(table)
    save(fig, args.out, table)

if __name__ == "__main__":
    main()
