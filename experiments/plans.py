"""
experiments/plans.py: what campaign.py runs. An arm is a set of train_grpo.py flags (the
loss), a variant another (the dtypes and fixes), a plan a list of (arm, variants) in priority
order; a run is one (arm, variant, seed), named ARM-VARIANT-sSEED.

    python experiments/campaign.py --plan PLAN --seeds 0 1 2 3 4   # runs a plan, resumable

No torch here: the figures read these names too. Add an arm, a variant or a plan here and the
campaign runs it; results go to results/<machine>/ (campaign.py).
"""
import re

ARMS = {  # the flags every variant of an arm shares
    # the mismatch inside the trust region: pi_old = mu, GSPO's narrow clip
    "gspo-engine": ["--algorithm", "gspo", "--behavior-logp", "engine"],
    "drgrpo-mb4": ["--dr-grpo", "--minibatches", "4"],  # the paper's recipe
    "grpo": [],  # the default run
    "gspo": ["--algorithm", "gspo"],  # arm 1 without the mismatch in it
    # the paper's patches where the mismatch bites
    "seq-mis-engine": ["--algorithm", "seq-mis", "--behavior-logp", "engine"],
    "pg-seq-is": ["--algorithm", "pg-seq-is"],
    "token-tis": ["--algorithm", "token-tis"],  # pi_old the trainer's: w_t = pi_old / mu
}
# The dial's length arms: responses of 2 x 20 tokens, not 2 x 12. 24 items' warm start reaches
# only 0.78 held-out on the Intel Xeon with AMX (seed 0), 20 items' 0.85 (dial.md).
LENGTH_ITEMS = 20
for arm in ("grpo", "gspo-engine"):
    ARMS[f"{arm}-len{LENGTH_ITEMS}"] = [*ARMS[arm], "--n-items", str(LENGTH_ITEMS)]
VARIANTS = {
    "fp16": ["--dtype", "fp16"],
    "bf16": ["--dtype", "bf16"],
    "fp32": ["--dtype", "fp32"],
    "bf16-head32": ["--dtype", "bf16", "--lm-head", "fp32"],
    "bf16-engine32": ["--dtype", "bf16", "--engine-dtype", "fp32"],
    "bf16-aligned": ["--dtype", "bf16", "--trainer-kernels", "engine"],
}
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
# The mismatch dial (dial.py): the bf16 trainer on the engine's kernels (mismatch 0) with the
# engine's logits perturbed, DOSE x the chip's bf16 mismatch on the warm start, in two shapes.
DIAL_DOSES = (1, 3, 10, 30, 100)
DIAL_SHAPES = ("uniform", "bf16", "temperature", "persistent")  # dial.py
for shape in DIAL_SHAPES:
    for dose in DIAL_DOSES:
        VARIANTS[f"bf16-aligned-dial{dose}-{shape}"] = VARIANTS["bf16-aligned"]

def by_dose(arms, doses, shape="uniform", control=None):
    """(arm, variants) of each arm at each dose, in the order given; with control (by
    default, the uniform shape's), the first (top) dose's entry carries dose 0, the
    aligned run itself (once: every shape's control)."""
    control = shape == "uniform" if control is None else control
    def first(d):
        return ["bf16-aligned"] * (control and d == doses[0])
    return [(arm, first(d) + [f"bf16-aligned-dial{d}-{shape}"])
            for arm in arms for d in doses]

# Dose by dose from the top, every seed of one before the next: the top dose against dose 0
# first, the contrast that answers most, paired as it lands. grpo and gspo-engine in both
# shapes first, then the paper's recipe.
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
# The rounding's causal test (causal.md), one plan for every chip.
# bf16 runs the library vLLM's loader picks: it truncates to bf16
# without AVX-512-BF16, rounds to nearest with it. With it, the
# -trunc variants force the truncating library; without, they would
# repeat bf16 and bf16-aligned, and plan_runs leaves them out.
# -rotary-torch: vLLM's rotary embedding on torch's path, which
# rounds; a fix with no rebuild. The attention's output still truncates.
TRUNCATING = "_C_AVX512"  # rounding.py's table: its bf16 kernels truncate
VARIANTS["bf16-rotary-torch"] = VARIANTS["bf16-trunc"] = VARIANTS["bf16"]
VARIANTS["bf16-trunc-aligned"] = VARIANTS["bf16-aligned"]
# On a chip whose library rounds, its rotary already rounds: the
# -trunc variants, the contrast that chip exists for, go first.
ROUNDING = ["bf16", "fp16", "bf16-aligned", "bf16-trunc", "bf16-trunc-aligned",
            "bf16-rotary-torch"]
# The AMX control (causal.md): on AMX, bf16 runs AMX's attention
# kernel, and -trunc hides it. -noamx hides it on the chip's own
# library: vector kernels that round, so that bf16-trunc against it
# differs in the rounding alone. Only where the chip has AMX.
VARIANTS["bf16-noamx"] = VARIANTS["bf16"]
WITH_AMX_CONTROL = [*ROUNDING, "bf16-noamx"]  # gspo-engine's; causal.py's order
PLANS["rounding"] = [("gspo-engine", WITH_AMX_CONTROL),
                     ("grpo", ROUNDING), ("drgrpo-mb4", ROUNDING)]
# The anatomy along a run (anatomy.py --init):
# seed 0's policies at --stop-after 5, 10 and 20. On AMX the
# truncating run and its control go first (plan_runs drops them elsewhere).
PLANS["anatomy"] = [("gspo-engine", ["bf16-trunc", "bf16-noamx", "bf16", "bf16-aligned"])]
# The dial with structure (dial.md): bias (temperature) and noise held
# along a sequence (persistent) against uniform noise, at the same mean
# |d| a token, on gspo-engine then grpo; the top dose first.
STRUCTURE_DOSES = (10, 3, 1)
PLANS["dial-structure"] = [
    entry for arm in ("gspo-engine", "grpo")
    for shape in ("temperature", "persistent", "uniform")
    for entry in by_dose([arm], STRUCTURE_DOSES, shape, shape == "temperature")]
# The swap (swap.md): a run that starts on one library and goes on
# from its stop at SWAP_STEP on the other; is the truncation needed
# to start a fall, or to keep a run in its dip? First the stops:
# --plan swap-stops --stop-after 10; then --plan swap resumes them.
SWAP_STEP = 10  # in the falling runs' dip (anatomy.md)
LATE_SWAP = 20  # the same swaps later: --stop-after 20, swap-late
SWAPS = {  # variant: (before, after, the update it swaps at)
    "bf16-trunc-to-noamx": ("bf16-trunc", "bf16-noamx", SWAP_STEP),
    "bf16-noamx-to-trunc": ("bf16-noamx", "bf16-trunc", SWAP_STEP)}

def swap_suffix(step):
    """A swap variant's name after the update it swaps at; none at 10."""
    return "" if step == SWAP_STEP else f"-at{step}"

SWAPS.update({v + swap_suffix(LATE_SWAP): (b, a, LATE_SWAP)
              for v, (b, a, _) in list(SWAPS.items())})
for swap, (_, after, _) in SWAPS.items():
    VARIANTS[swap] = VARIANTS[after]
BEFORE = list(dict.fromkeys(b for b, _, _ in SWAPS.values()))
PLANS["swap-stops"] = [("gspo-engine", BEFORE)]
for plan, step in (("swap", SWAP_STEP), ("swap-late", LATE_SWAP)):
    PLANS[plan] = [("gspo-engine", [v for v, s in SWAPS.items()
                                    if s[2] == step])]
# Arms whose final policies (and each seed's warm start) mismatch.py --quick also reads
PROBED = ("gspo-engine",)

def dial_of(variant):
    """(dose, shape) of a dial variant, or None."""
    m = re.search(r"-dial(\d+)-(\w+)$", variant)
    return (int(m.group(1)), m.group(2)) if m else None

def probed(name):  # the dial's and the length arms' runs are read by held-out accuracy alone
    arm = name.startswith(tuple(f"{arm}-" for arm in PROBED))
    return arm and "-dial" not in name and "-len" not in name

def plan_runs(plan, seeds, arms=None, isa=None):
    """(name, flags, campaign.py --run options) of every run: arm by
    arm, in an arm seed by seed: however far it got, an arm's variants
    have the same seeds, paired. With isa (the chip's ISA flags), the
    -trunc variants only where the native library rounds, -noamx only
    where there is AMX to hide."""
    def flags(arm, v, seed):
        return ["--seed", str(seed), *ARMS[arm], *VARIANTS[v]]
    def runs(v):
        needs = {"-trunc": "avx512_bf16", "-noamx": "amx_tile"}
        return isa is None or all(f in isa for k, f in needs.items() if k in v)
    return [(f"{arm}-{v}-s{seed}", flags(arm, v, seed), run_options(v))
            for arm, variants in PLANS[plan] if arm in (arms or [arm])
            for seed in seeds for v in variants if runs(v)]

def run_options(variant):
    """campaign.py --run's options for a variant: the dial's dose and
    shape; the kernels."""
    swap = SWAPS.get(variant)
    if swap:  # the after side's kernels, from the before side's stop
        return run_options(swap[1]) + ["--swap-from", swap[0]]
    dial = dial_of(variant)
    opts = ["--dial", str(dial[0]), "--dial-shape", dial[1]] if dial else []
    opts += ["--library", TRUNCATING] if "-trunc" in variant else []
    opts += ["--hide-amx"] if variant.endswith("-noamx") else []
    return opts + (["--rotary-torch"] if variant.endswith("-rotary-torch") else [])
