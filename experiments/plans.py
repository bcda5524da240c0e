"""
experiments/plans.py: what campaign.py runs. A plan is a list of (arm, variants) in priority
order (arms and variants: variants.py); a run is one (arm, variant, seed), named
ARM-VARIANT-sSEED.

    python experiments/campaign.py --plan PLAN --seeds 0 1 2 3 4   # runs a plan, resumable

No torch here: the figures read these names too. Add a plan here (a variant in variants.py)
and the campaign runs it; results go to results/<machine>/ (campaign.py).
"""
from variants import (ARMS, DIAL_DOSES, LATE_SWAP, LENGTH_ITEMS, PROBED, SITE_MODES, SITE_SWAPS,
                      LIBRARY_SWAPS, SWAP_STEP, SWAPS, VARIANTS, parse_run, runs_on)

EVERY_FIX = ["fp16", "bf16", "fp32", "bf16-head32", "bf16-engine32",
             "bf16-aligned"]
FORMATS = ["fp16", "bf16", "fp32", "bf16-aligned"]
PLANS = {  # arms in priority order, each with its variants
    "campaign": [("gspo-engine", EVERY_FIX), ("drgrpo-mb4", FORMATS),
                 ("grpo", FORMATS), ("gspo", ["fp16", "bf16"]),
                 ("seq-mis-engine", ["fp16", "bf16"]), ("pg-seq-is", ["fp16", "bf16"])],
    "extend": [("gspo-engine", FORMATS)],  # arm 1's borderline cells, --seeds 5 6 7
    "extend-grpo": [("grpo", FORMATS)],  # arm 3's borderline cells, --seeds 5 6 7
    "extend-gspo": [("gspo", ["fp16", "bf16"])],  # arm 4 against arm 1's seeds 5-7
    "extend-rest": [("gspo-engine", ["bf16-head32", "bf16-engine32"]),
                    ("drgrpo-mb4", FORMATS), ("seq-mis-engine", ["fp16", "bf16"]),
                    ("pg-seq-is", ["fp16", "bf16"])],  # the cells left at five
    # the cross-probe at step 8, with --stop-after 8
    "midrun": [("gspo-engine", ["fp16", "bf16"])],
    "smoke": [("grpo", ["fp32"])],  # the tests' plan: one run per seed
}

def by_dose(arms, doses, shape="uniform", control=None):
    """(arm, variants) of each arm at each dose, in the order given; with control (by
    default, the uniform shape's), the first (top) dose's entry carries dose 0, the
    aligned run itself (once: every shape's control)."""
    control = shape == "uniform" if control is None else control

    def first(d):
        return ["bf16-aligned"] * (control and d == doses[0])

    return [(arm, first(d) + [f"bf16-aligned-dial{d}-{shape}"])
            for arm in arms for d in doses]

# The dial (dial.md), dose by dose from the top, every seed of one before the next: the top
# dose against dose 0 first, the contrast that answers most, paired as it lands. grpo and
# gspo-engine in both shapes first, then the paper's recipe.
PLANS["dial"] = [entry for arms in (("grpo", "gspo-engine"), ("drgrpo-mb4",))
                 for shape in ("uniform", "bf16")
                 for entry in by_dose(arms, DIAL_DOSES[::-1], shape)]
# The length arms at two doses: 10x, where gspo-engine's loss passes 0.01 held-out on the Intel
# Xeon with AMX (13x, uniform, n = 5), and 100x, the top, where vanilla GRPO would lose first.
LENGTH_DOSES = (100, 10)
LENGTH_ARMS = [f"{a}-len{LENGTH_ITEMS}" for a in ("grpo", "gspo-engine")]
PLANS["dial-length"] = by_dose(LENGTH_ARMS, LENGTH_DOSES)
# The fixes at the doses where harm shows: gspo-engine loses from 10x on the Intel Xeon with
# AMX. First gspo with the trainer's pi_old, the ablation of the mechanism (the mismatch out
# of the clip), then the patches; each against its own dose 0.
PATCH_DOSES = (100, 10)
PATCH_ARMS = ("gspo", "token-tis", "seq-mis-engine", "pg-seq-is")
PLANS["dial-patches"] = by_dose(PATCH_ARMS, PATCH_DOSES)
# The paper's recipe's tail (exploratory): one run in 25 of its bf16-shaped dial (10x, seed 3)
# did not recover from the dip that every seed of it shows at dose 0. Ten new seeds at dose 0
# and that dose: --seeds 5 6 7 8 9 10 11 12 13 14.
PLANS["dial-tail"] = [("drgrpo-mb4", ["bf16-aligned", "bf16-aligned-dial10-bf16"])]
# The rounding's causal test (causal.md), one plan for every chip; plan_runs leaves out the
# variants a chip cannot run. On a chip whose library rounds, its rotary already rounds: the
# -trunc variants, the contrast that chip exists for, go first.
ROUNDING = ["bf16", "fp16", "bf16-aligned", "bf16-trunc", "bf16-trunc-aligned",
            "bf16-rotary-torch"]
WITH_AMX_CONTROL = [*ROUNDING, "bf16-noamx"]  # gspo-engine's; causal.py's order
PLANS["rounding"] = [("gspo-engine", WITH_AMX_CONTROL),
                     ("grpo", ROUNDING), ("drgrpo-mb4", ROUNDING)]
# The anatomy along a run (anatomy.py --init): seed 0's policies at --stop-after 5, 10 and 20.
# On AMX the truncating run and its control go first.
PLANS["anatomy"] = [("gspo-engine", ["bf16-trunc", "bf16-noamx", "bf16", "bf16-aligned"])]
# The dial with structure (dial.md): bias (temperature) and noise held along a sequence
# (persistent) against uniform noise, at the same mean |d| a token, on gspo-engine then grpo;
# the top dose first.
STRUCTURE_DOSES = (10, 3, 1)
PLANS["dial-structure"] = [
    entry for arm in ("gspo-engine", "grpo")
    for shape in ("temperature", "persistent", "uniform")
    for entry in by_dose([arm], STRUCTURE_DOSES, shape, shape == "temperature")]
# The swap (swap.md): first the stops, --plan swap-stops --stop-after 10 (20 for swap-late);
# then --plan swap (swap-late) resumes them on the other library.
BEFORE = list(dict.fromkeys(b for b, _, _ in SWAPS.values()))
PLANS["swap-stops"] = [("gspo-engine", BEFORE)]
for _plan, _step in (("swap", SWAP_STEP), ("swap-late", LATE_SWAP)):
    PLANS[_plan] = [("gspo-engine", [v for v in LIBRARY_SWAPS if SWAPS[v][2] == _step])]

# Size or sign (sites.md): the trainer's rounding at the two sites, gspo-engine, each chip its part.
# Where the engine rounds (AMX hidden): the control, then truncation, away from zero and the two
# zero-mean modes of truncation's size on the trainer's side. Where it truncates: the chip's bf16
# and bf16-aligned, then the trainer truncating like its engine and rne6. On a chip whose own
# library rounds, the same two against its truncating library forced (bf16-trunc's control), and
# sym, rne6's redraw, nudge, the neutral change (symredraw.md), and nudge8, nudge16, nudge3of16,
# nudge3of8 and nudge7of16, its doses (nudgedose.md, nudgedose316.md, nudgedose-amd.md), and nudge
# at the trainer's matmuls instead of the two sites (matmulnudge.md), sym at the LM head alone and
# the nudge at the blocks' linears alone (headnudge.md), and the cheap fix's sign with a zero-mean
# step added, 1 or 2 ulp (truncpm-amd.md), and at half or a quarter of the values
# (truncdose-amd.md); without AMX the four modes against its own library (bf16's control). nudge and
# the blocks' nudge against the rounding engine too (AMX hidden: their cost).
PLANS["sites"] = [("gspo-engine", ["bf16-noamx", *(f"bf16-noamx-site-{m}" for m in SITE_MODES),
                                   "bf16-noamx-site-nudge", "bf16-noamx-blocks-nudge",
                                   "bf16", "bf16-aligned", *(f"bf16-site-{m}" for m in SITE_MODES),
                                   "bf16-trunc", "bf16-trunc-site-trunc",
                                   "bf16-trunc-site-rne6", "bf16-trunc-site-sym",
                                   "bf16-trunc-site-nudge", "bf16-trunc-site-nudge8",
                                   "bf16-trunc-site-nudge16",
                                   "bf16-trunc-site-nudge3of16", "bf16-trunc-site-nudge3of8",
                                   "bf16-trunc-site-nudge7of16", "bf16-trunc-matmul-nudge",
                                   "bf16-trunc-head-sym", "bf16-trunc-blocks-nudge",
                                   "bf16-trunc-site-truncpm", "bf16-trunc-site-truncpm2",
                                   "bf16-trunc-site-trunc1of2", "bf16-trunc-site-trunc1of4"])]
# Then grpo for the variants that fell in gspo-engine (sites.md), five seeds, with their control;
# without AMX, the two that fell against the chip's own library, bf16 their control (where that
# library truncates, bf16-site-trunc is the cheap fix: it runs in grpo if it fell; sites-xeon.md).
# Against the truncating library forced, sym and nudge16 fell at sixteen seeds (symredraw-grpo.md).
PLANS["sites-grpo"] = [("grpo", ["bf16-noamx", "bf16-noamx-site-trunc", "bf16-noamx-site-away",
                                "bf16-trunc", "bf16-trunc-site-rne6", "bf16", "bf16-site-trunc",
                                "bf16-site-away", "bf16-trunc-site-sym",
                                "bf16-trunc-site-nudge16"])]
# The trainer's side swapped in bf16-trunc's dip (sites-swap.md): from the same stops as plan
# swap's (--plan swap-stops --stop-after 10), the trainer truncating like its engine or at rne6.
PLANS["sites-swap"] = [("gspo-engine", SITE_SWAPS)]
# The CPU trainer's embedding backward as a GPU's (embed32.md): against the truncating library
# forced first (does GSPO still fall?), then against the chip's own; bf16-trunc and bf16 their
# controls (where plan sites or rounding ran, they are there).
# bf16-trunc-embedrev: torch's bf16 sums in another order, the neutral change (embedrev.md)
PLANS["embed32"] = [("gspo-engine", ["bf16-trunc", "bf16-trunc-embed32", "bf16",
                                     "bf16-embed32", "bf16-trunc-embedrev"])]
# The CPU trainer as near a GPU's as it goes (gpulike.md): embed32's backward and a fused
# kernel's attention, against the truncating library forced, then against the chip's own.
PLANS["gpulike"] = [("gspo-engine", ["bf16-trunc", "bf16-trunc-gpulike", "bf16", "bf16-gpulike",
                                     "bf16-trunc-fused"])]  # its attention alone: gpulike-seeds.md
# Scale (scale.md): the headline contrast and the cheap fix on a GPT eight times larger, five
# seeds: the truncating library forced first, then its rounding control, the cheap fix, and the
# aligned trainer; a seed's four runs before the next seed's.
PLANS["scale"] = [("gspo-engine-x8", ["bf16-trunc", "bf16-noamx", "bf16-trunc-site-trunc",
                                      "bf16-trunc-aligned"])]
# On a chip whose own library rounds without AMX (none to hide, so no bf16-noamx), the same
# contrast with that library, bf16, as the rounding control (scale.md).
PLANS["scale-own"] = [("gspo-engine-x8", ["bf16-trunc", "bf16", "bf16-trunc-site-trunc",
                                          "bf16-trunc-aligned"])]
# The paper's fix on the larger GPT (scale-fp16.md): fp16 on both sides beside bf16 on the chip's
# own library, a seed's two before the next seed's (where plan scale-own ran, bf16's are there);
# then the 0.9M GPT's pair, --arms gspo-engine (where plan sites ran, bf16's are there).
PLANS["scale-fp16"] = [("gspo-engine-x8", ["bf16", "fp16"]), ("gspo-engine", ["bf16", "fp16"])]
# The trainer's rounding at the two sites on the larger GPT (scale-sites.md), against the chip's
# own library, as plan sites' bf16-site-* (variants.py): where it rounds, truncation and rne6 ask
# sign or size, and the aligned trainer what the mismatch costs; where it truncates (AVX2 only),
# truncation is the cheap fix. bf16 first (where plan scale-own or scale-fp16 ran, it is there).
PLANS["scale-sites"] = [("gspo-engine-x8", ["bf16", "bf16-aligned", "bf16-site-trunc",
                                            "bf16-site-rne6"])]
# The size dial on the larger GPT (scale-rne5.md): where the engine rounds, a zero-mean error
# twice rne6's at the op, beside plan scale-sites' bf16 and bf16-site-trunc (there, those).
PLANS["scale-rne5"] = [("gspo-engine-x8", ["bf16", "bf16-site-trunc", "bf16-site-rne5"])]
# Vanilla GRPO on the larger GPT (scale-grpo.md), pi_old the trainer's: the trainer truncating
# at the two sites, which made gspo-engine-x8 fall in 7 of 7 where the engine rounds, beside bf16
# (sites-grpo's question, on the 7M GPT); a seed's two runs before the next seed's.
PLANS["scale-grpo"] = [("grpo-x8", ["bf16", "bf16-site-trunc"])]
# The same with the engine's truncating library forced (scale-grpo.md), which made gspo-engine-x8
# fall in 8 of 8 here: the "grpo for every variant that fell", its other one at 7M.
PLANS["scale-grpo-trunc"] = [("grpo-x8", ["bf16", "bf16-trunc"])]
# The CPU trainer's embedding backward as a GPU's on the larger GPT (embed32.md), where the
# truncating library forced made gspo-engine-x8 fall in 8 of 8 here: does it still?
PLANS["scale-embed32"] = [("gspo-engine-x8", ["bf16-trunc", "bf16-trunc-embed32"])]
# The cheap fix's sign without its size on the larger GPT (scale-truncpm2.md): against the
# truncating library forced, the trainer truncating like it, then 2 ulp up or down by the coin,
# beside plan scale's (or scale-own's) bf16-trunc and the cheap fix (where it ran, they are there).
PLANS["scale-truncpm2"] = [("gspo-engine-x8", ["bf16-trunc", "bf16-trunc-site-trunc",
                                               "bf16-trunc-site-truncpm2"])]
# A zero-mean rounding at the two sites against the truncating library forced on the larger GPT
# (scale-sym.md): sym lifted the 0.9M GPT's falls from 12 to 4 of 16 on the AMD EPYC; at 7M,
# beside the same bf16-trunc and the cheap fix (where they ran, they are there).
PLANS["scale-sym"] = [("gspo-engine-x8", ["bf16-trunc", "bf16-trunc-site-trunc",
                                          "bf16-trunc-site-sym"])]

def probed(name):
    """Whether mismatch.py --quick reads a run's policy: a PROBED arm's run of a probed variant
    (the dial's and the length arms' runs are read by held-out accuracy alone)."""
    arm, variant, _ = parse_run(name)
    return arm in PROBED and variant.probed

def plan_runs(plan, seeds, arms=None, isa=None, variants=None):
    """(name, flags, variant) of every run: arm by arm, in an arm seed by seed: however far it
    got, an arm's variants have the same seeds, paired. With isa (the chip's ISA flags), only
    the variants this chip can run (variants.Variant.needs); with variants, those on each of
    the plan's arms (or arms) instead of the plan's own."""
    entries = PLANS[plan]
    if variants:
        entries = [(arm, variants) for arm in dict.fromkeys(a for a, _ in entries)]
    return [(f"{arm}-{v}-s{seed}", ["--seed", str(seed), *ARMS[arm], *VARIANTS[v].flags],
             VARIANTS[v])
            for arm, vs in entries if arm in (arms or [arm])
            for seed in seeds for v in vs if isa is None or runs_on(VARIANTS[v], isa)]
