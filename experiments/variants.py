"""
experiments/variants.py: what a run is. An arm is a set of train_grpo.py flags (the loss), a
variant one record (the dtypes, the fixes, the engine's options); a run is one (arm, variant,
seed), its folder named ARM-VARIANT-sSEED. plans.py lists runs, campaign.py runs them,
results.py and every figure read them back: all from the records here.

Add a variant with one `add(Variant(...))`: its flags, its engine options, its colour and the
chips that can run it. A record's fields say everything about it; no code reads its name.

    field          what it does to a run                      recorded in args.json as
    flags          train_grpo.py flags                        dtype, engine_dtype, lm_head, ...
    library        vLLM's kernels from this library           kernel_library
    hide_amx       the chip's own library, AMX hidden         amx_hidden (kernel_library _C)
    rotary_torch   vLLM's rotary embedding on torch's path    engine_custom_ops
    dial           (dose, shape): dial.py's noise on the      dial_dose, dial_shape
                   engine's logits
    swap           (before, update): goes on from the         swap_from, swap_step
                   before variant's stop at that update
    site_rounding  the trainer's bf16 rounding at the rotary  site_rounding
                   and the attention outputs (sites.py)
    embed_grad     the CPU trainer's embedding backward:      embed_grad
                   summed in its dtype (torch's) or float32
                   as a GPU's (embed32.py)
    attention_weights
                   the CPU trainer's softmax weights before   attention_weights
                   V: float32 (the emulation's) or rounded to
                   the dtype, as a fused kernel's (fused.py)
    warm_seed      starts from this seed's warm start; the     warm_seed, init
                   task and the RL stream stay the run's
    init_seed      its warm start's initial weights from this  init_seed, init
                   seed; its supervised batches the start's
    needs          the ISA flags a chip must have             (plans.plan_runs drops it elsewhere)
    lacks          the ISA flags a chip must not have         (the same)
    probed         mismatch.py --quick reads its policy       (in PROBED arms)

No torch here: the figures read these records too.
"""
import re
from dataclasses import dataclass

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
for _arm in ("grpo", "gspo-engine"):
    ARMS[f"{_arm}-len{LENGTH_ITEMS}"] = [*ARMS[_arm], "--n-items", str(LENGTH_ITEMS)]
# Scale (scale.md): gspo-engine with a GPT about eight times larger (6.95M parameters against
# 0.92M), its head size the default's (32), its own warm start; not PROBED: mismatch.py --quick
# reads the 0.9M GPT's warm start beside a run.
SCALE = ["--n-layer", "8", "--n-head", "8", "--n-embd", "256"]
SMALLER = {"gspo-engine-x8": "gspo-engine", "grpo-x8": "grpo"}  # each larger arm: its 0.9M twin
for _large, _small in SMALLER.items():  # one warm start a seed for both: the arm leaves the model
    ARMS[_large] = [*ARMS[_small], *SCALE]
PROBED = ("gspo-engine",)  # arms whose policies mismatch.py --quick also reads

@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple  # train_grpo.py's
    library: str = None  # rounding.LIBRARIES: vLLM's kernels from this one
    hide_amx: bool = False
    rotary_torch: bool = False
    dial: tuple = None  # (dose, shape)
    swap: tuple = None  # (before variant, the update it swaps at)
    site_rounding: str = "rne"  # sites.MODES
    embed_grad: str = "dtype"  # EMBED_GRAD
    attention_weights: str = "float32"  # ATTENTION_WEIGHTS
    warm_seed: int = None  # None: the run's own seed's warm start
    init_seed: int = None  # None: the warm start's seed's initial weights
    color: str = None  # matplotlib's; None: the figure's default cycle
    needs: tuple = ()  # ISA flags (instruments.machine's cpu_isa)
    lacks: tuple = ()
    probed: bool = True

    def recorded(self):
        """What a run of it writes into args.json (train_grpo's flags with their defaults, the
        engine options campaign.train_run records): variant_of matches it."""
        loaded = self.library or ("_C" if self.hide_amx else None)  # rounding.load's answer
        return (*formats(self.flags), loaded, self.hide_amx, self.rotary_torch, self.dial,
                self.swap, self.site_rounding, self.embed_grad, self.attention_weights,
                self.warm_seed, self.init_seed)

def formats(flags):
    """The dtypes and kernels a list of train_grpo.py flags sets, its defaults where absent."""
    dtype = option(flags, "--dtype", "fp16")
    return (dtype, option(flags, "--engine-dtype", dtype), option(flags, "--lm-head", "same"),
            option(flags, "--trainer-kernels", "torch"))

VARIANTS = {}

def add(v):
    """Register one variant; a second with its name or its record is refused."""
    if v.name in VARIANTS or any(w.recorded() == v.recorded() for w in VARIANTS.values()):
        raise ValueError(f"variant {v.name}: its name or its record is taken")
    VARIANTS[v.name] = v
    return v

def option(flags, name, default=None):
    """The value of a flag in a list of flags, or default."""
    flags = list(flags)
    return flags[flags.index(name) + 1] if name in flags else default

BF16, ALIGNED = ("--dtype", "bf16"), ("--dtype", "bf16", "--trainer-kernels", "engine")
add(Variant("fp16", ("--dtype", "fp16"), color="tab:blue"))
add(Variant("bf16", BF16, color="tab:red"))
add(Variant("fp32", ("--dtype", "fp32"), color="0.35"))
add(Variant("bf16-head32", (*BF16, "--lm-head", "fp32"), color="tab:orange"))
add(Variant("bf16-engine32", (*BF16, "--engine-dtype", "fp32"), color="tab:purple"))
add(Variant("bf16-aligned", ALIGNED, color="tab:green"))
# The rounding's causal test (causal.md). bf16 runs the library vLLM's loader picks: it
# truncates to bf16 without AVX-512-BF16, rounds to nearest with it. With it, the -trunc
# variants force the truncating library; without, they would repeat bf16 and bf16-aligned.
# -rotary-torch: vLLM's rotary embedding on torch's path, which rounds; a fix with no
# rebuild. The attention's output still truncates.
TRUNCATING = "_C_AVX512"  # rounding.py's table: its bf16 kernels truncate
add(Variant("bf16-rotary-torch", BF16, rotary_torch=True, color="tab:brown"))
add(Variant("bf16-trunc", BF16, library=TRUNCATING, color="tab:pink",
            needs=("avx512_bf16",)))
add(Variant("bf16-trunc-aligned", ALIGNED, library=TRUNCATING, color="tab:olive",
            needs=("avx512_bf16",)))
# The AMX control: on AMX, bf16 runs AMX's attention kernel, and -trunc hides it. -noamx hides
# it on the chip's own library: vector kernels that round, so that bf16-trunc against it
# differs in the rounding alone. Only where the chip has AMX.
add(Variant("bf16-noamx", BF16, hide_amx=True, color="tab:cyan", needs=("amx_tile",)))
# The mismatch dial (dial.py): the bf16 trainer on the engine's kernels (mismatch 0) with the
# engine's logits perturbed, DOSE x the chip's bf16 mismatch on the warm start, in four shapes.
DIAL_DOSES = (1, 3, 10, 30, 100)
DIAL_SHAPES = ("uniform", "bf16", "temperature", "persistent")  # dial.py
for _shape in DIAL_SHAPES:
    for _dose in DIAL_DOSES:
        add(Variant(f"bf16-aligned-dial{_dose}-{_shape}", ALIGNED, dial=(_dose, _shape),
                    probed=False))  # the dial's runs are read by held-out accuracy alone
# The swap (swap.md): a run that starts on one library and goes on from its stop at SWAP_STEP
# on the other; is the truncation needed to start a fall, or to keep a run in its dip?
SWAP_STEP = 10  # in the falling runs' dip (anatomy.md)
LATE_SWAP = 20  # the same swaps later
SWAPS = {}  # swap variant: (before, after, the update it swaps at)

def add_swap(before, after, short, step, suffix="", color=None, lacks=()):
    """A run that goes on from `before`'s stop at `step` as `after` (its flags, its kernels,
    its site rounding): named BEFORE-to-SHORT, and its colour the before side's unless given;
    it runs where both sides run, and not on a chip with any of `lacks`."""
    a, b = VARIANTS[after], VARIANTS[before]
    v = add(Variant(f"{before}-to-{short}{suffix}", a.flags, a.library, a.hide_amx,
                    swap=(before, step), site_rounding=a.site_rounding, color=color,
                    needs=tuple(dict.fromkeys((*b.needs, *a.needs))),
                    lacks=tuple(dict.fromkeys((*b.lacks, *a.lacks, *lacks)))))
    SWAPS[v.name] = (before, after, step)
    return v.name

LIBRARY_SWAPS = [add_swap(_before, _after, _short, _step, _suffix)
                 for _step, _suffix in ((SWAP_STEP, ""), (LATE_SWAP, f"-at{LATE_SWAP}"))
                 for _before, _after, _short in (("bf16-trunc", "bf16-noamx", "noamx"),
                                                 ("bf16-noamx", "bf16-trunc", "trunc"))]

# Size or sign (sites.md): the trainer rounds to bf16 at the two sites in another mode, each
# with the same mean |error| at the op as truncation's. On a chip whose engine rounds (AMX
# hidden, as bf16-noamx): does truncation on the trainer's side alone, away from zero, or a
# zero-mean error of truncation's size make GSPO fall? On a chip whose engine truncates: the
# trainer truncating like it (the cheap fix), and a zero-mean error of that size.
SITE_MODES = ("trunc", "away", "rne6", "sym")  # plan sites' four, one mean |error| at the op
# nudge's pushes, in ulp: rne's rule with the value pushed that far either way first (sites.py)
NUDGE_PUSH = {"nudge": 1 / 4, "nudge8": 1 / 8, "nudge16": 1 / 16, "nudge3of16": 3 / 16,
              "nudge3of8": 3 / 8, "nudge7of16": 7 / 16}
# truncpm's steps, in ulp: truncation's rule, then that far up or down in size by the coin, so
# truncation's one-signed error kept and a zero-mean one added against a truncating engine
TRUNC_STEP = {"truncpm": 1, "truncpm2": 2}
# truncation's dose: the share of the values the trainer truncates like the engine (by the coin),
# the rest to nearest: a share p of its sign matched, 1 - p of its one-signed difference left
TRUNC_SHARE = {"trunc1of2": 1 / 2, "trunc1of4": 1 / 4}
# Modes that leave the two sites at rne and round the trainer's matmul outputs by a rule instead,
# where the engine rounds to nearest too: mode -> (the rule, where: "every" matmul but the
# attention's, the blocks' linears and the LM head, the "head" alone, or the "blocks'" linears
# alone; matmulnudge.md, headnudge.md). At the head alone the rule moves the logits and nothing
# before them; at the blocks alone, everything before the head, the head rounding to nearest.
AT_MATMULS = {"nudge-matmuls": ("nudge", "every"), "nudge-head": ("nudge", "head"),
              "sym-head": ("sym", "head"), "nudge-blocks": ("nudge", "blocks")}
SITE_ROUNDING = ("rne", *SITE_MODES, "rne5", *NUDGE_PUSH, *TRUNC_STEP, *TRUNC_SHARE,
                 *AT_MATMULS)  # sites'
SITE_COLORS = {"trunc": "chocolate", "away": "darkmagenta", "rne6": "mediumseagreen",
               "sym": "steelblue"}  # apart from bf16's red, which they are read against
for _mode in SITE_MODES:
    add(Variant(f"bf16-noamx-site-{_mode}", BF16, hide_amx=True, site_rounding=_mode,
                needs=("amx_tile",), color=SITE_COLORS[_mode]))
# nudge, the neutral change (symredraw.md), against the rounding engine: does it cost anything
# where the engine's difference from the trainer is not a fixed function of the dropped bits?
add(Variant("bf16-noamx-site-nudge", BF16, hide_amx=True, site_rounding="nudge",
            needs=("amx_tile",), color="darkgoldenrod"))
# On a chip without AMX, on its own library: where it truncates (AVX2 only), the trainer
# truncating like its engine (the cheap fix) and a zero-mean error of that size; where it rounds
# (AVX-512-BF16), the rounding-engine ablation again, on another chip, without AMX to hide.
for _mode in SITE_MODES:
    add(Variant(f"bf16-site-{_mode}", BF16, site_rounding=_mode, lacks=("amx_tile",),
                needs=() if _mode in ("trunc", "rne6") else ("avx512_bf16",),
                color=SITE_COLORS[_mode]))
# The size dial on the 7M GPT (scale-rne5.md): there rne6 and sym made about 0.6x the token
# mismatch trunc made, so a zero-mean error of twice their size at the op, 5 kept bits.
add(Variant("bf16-site-rne5", BF16, site_rounding="rne5", lacks=("amx_tile",),
            needs=("avx512_bf16",), color="olivedrab"))
# The same against this chip's truncating library forced (bf16-trunc, whose seeds are their
# control), on a chip whose own library rounds: the cheap fix where its engine rounds. sym is
# rne6's redraw (symredraw.md): zero-mean, the same mean |error| at the op, another rule; nudge
# the neutral change, rne's rule with a quarter of the values a step the other way; nudge8 and
# nudge16 its doses (nudgedose.md), an eighth and a sixteenth of them: where does the lift start?
# nudge3of16, 3/16 of them (nudgedose316.md): between an eighth and a quarter, a grade or a step?
# nudge3of8, 3/8 of them (nudgedose-amd.md): where a quarter did not lift and sym's half did;
# nudge7of16, 7/16 of them (the same page): between 3/8 and a half, where the lift came.
for _mode, _color in (("trunc", "teal"), ("rne6", "navy"), ("sym", "cadetblue"),
                      ("nudge", "darkkhaki"), ("nudge8", "darkorange"), ("nudge16", "goldenrod"),
                      ("nudge3of16", "peru"), ("nudge3of8", "sienna"),
                      ("nudge7of16", "saddlebrown")):
    add(Variant(f"bf16-trunc-site-{_mode}", BF16, library=TRUNCATING, site_rounding=_mode,
                needs=("avx512_bf16",), color=_color))
# The cheap fix's sign kept, its size undone (truncpm-amd.md): the trainer truncating like its
# engine, then a step of 1 or 2 ulp up or down by the coin, zero-mean against the engine's
# truncation. Does the cheap fix hold by the sign it matches or by the mismatch it shrinks?
for _mode, _color in (("truncpm", "lightseagreen"), ("truncpm2", "darkturquoise")):
    add(Variant(f"bf16-trunc-site-{_mode}", BF16, library=TRUNCATING, site_rounding=_mode,
                needs=("avx512_bf16",), color=_color))
# The cheap fix at half the values (truncdose-amd.md): its sign half matched. All or a grade?
# trunc1of4, at a quarter of them (the same page): where half held in every seed, a grade below?
for _mode, _color in (("trunc1of2", "mediumaquamarine"), ("trunc1of4", "aquamarine")):
    add(Variant(f"bf16-trunc-site-{_mode}", BF16, library=TRUNCATING, site_rounding=_mode,
                needs=("avx512_bf16",), color=_color))
# nudge's rule at the trainer's matmul outputs, the two sites left at rne (matmulnudge.md): does
# changing the forward where the engine rounds to nearest lift as nudge at the two sites did?
add(Variant("bf16-trunc-matmul-nudge", BF16, library=TRUNCATING, site_rounding="nudge-matmuls",
            needs=("avx512_bf16",), color="slategray"))
# sym's rule at the LM head's output alone (headnudge.md): the logits redrawn by about as much
# as the matmuls' nudge redraws the answer tokens' log-probs, the path before them untouched.
# Does the log-ratio's redraw lift, or does the lift need the path?
add(Variant("bf16-trunc-head-sym", BF16, library=TRUNCATING, site_rounding="sym-head",
            needs=("avx512_bf16",), color="lightslategray"))
# The matmuls' nudge without the head (headnudge.md): the path before the logits moved as the
# matmuls' nudge moves it, the head rounding to nearest. Does it lift as the whole did?
add(Variant("bf16-trunc-blocks-nudge", BF16, library=TRUNCATING, site_rounding="nudge-blocks",
            needs=("avx512_bf16",), color="darkslategray"))
# The blocks' nudge against the rounding engine (AMX hidden, as bf16-noamx; blocksnudge-noamx.md):
# it lifted GSPO against the truncating library; does it cost anything where the engine rounds?
add(Variant("bf16-noamx-blocks-nudge", BF16, hide_amx=True, site_rounding="nudge-blocks",
            needs=("amx_tile",), color="darkcyan"))
# The CPU trainer's embedding backward summed in float32, as a GPU sums it (embed32.md): the
# bf16 emulation's backward sums a token's rows in bf16, where most of its gradient's error
# lies. Against the truncating library forced, does GSPO still fall? Against the chip's own?
EMBED_GRAD = ("dtype", "float32", "reversed")  # embed32.py's: torch's, a GPU's, torch's reordered
add(Variant("bf16-embed32", BF16, embed_grad="float32", color="lightcoral"))
add(Variant("bf16-trunc-embed32", BF16, library=TRUNCATING, embed_grad="float32",
            needs=("avx512_bf16",), color="mediumvioletred"))
# The CPU trainer as near a GPU's as it goes (gpulike.md): embed32's backward, and the attention
# as a fused kernel's, its softmax weights rounded to bf16 before V (fused.py). Against the
# truncating library forced: a GPU's trainer against a truncating engine.
ATTENTION_WEIGHTS = ("float32", "dtype")  # fused.py's: the emulation's, or a fused kernel's
add(Variant("bf16-gpulike", BF16, embed_grad="float32", attention_weights="dtype",
            color="rosybrown"))
add(Variant("bf16-trunc-gpulike", BF16, library=TRUNCATING, embed_grad="float32",
            attention_weights="dtype", needs=("avx512_bf16",), color="darkred"))
# The fused kernel's attention alone (gpulike-seeds.md): which of gpulike's two parts moved it?
add(Variant("bf16-trunc-fused", BF16, library=TRUNCATING, attention_weights="dtype",
            needs=("avx512_bf16",), color="sienna"))
# The neutral change (embedrev.md): the embedding's rows summed in bf16 as torch sums them,
# last position first; its error embed32 removes, the same kind and size, drawn again.
add(Variant("bf16-trunc-embedrev", BF16, library=TRUNCATING, embed_grad="reversed",
            needs=("avx512_bf16",), color="palevioletred"))

# The trainer's side swapped (sites-swap.md): a run against a truncating engine goes on from
# its stop at SWAP_STEP, in the dip, the engine still truncating and the trainer now truncating
# like it (the cheap fix, mid-run) or rounding to 6 bits (zero-mean, the mismatch's size kept).
# Where the chip's own library rounds, from bf16-trunc's stops; where it truncates, from bf16's
# (bf16 dips only there: not on a chip with AVX-512-BF16).
SITE_SWAPS = [add_swap(_before, f"{_before}-site-{_mode}", f"site-{_mode}", SWAP_STEP,
                       color=_color, lacks=_lacks)
              for _before, _lacks in (("bf16-trunc", ()), ("bf16", ("avx512_bf16",)))
              for _mode, _color in (("trunc", "goldenrod"), ("rne6", "slateblue"))]

# The seed crossed (seedfalls.md): against the truncating library, rne6 at the two sites fell on
# seeds 5 and 14 alone of 16, and those two fell in nearly every variant read at 16 seeds. A seed
# picks a run's warm start and its RL stream (task splits, batches, samples); these start from
# another seed's warm start, the run's seed keeping the rest. Does a fall go with the start?
# On the AMD EPYC (seedfalls-amd.md) seeds 0 and 14 fell in all six variants read at 16 seeds,
# seeds 3, 11, 12 and 13 in at most one, rne6 on none of the four: the same crossing there.
# Then sym, the other zero-mean rule (fell there on 0, 5, 7, 14), as a second base: 8 runs.
CROSS_WARM = {"rne6": (0, 1, 2, 3, 5, 14,  # AMX: 5, 14 the falls; 0-3 the first four held
                       11, 12, 13),  # AMD: 0, 14 the falls; 3, 11-13 the held
              "sym": (0, 3, 11, 14)}  # AMD
for _mode, _seeds in CROSS_WARM.items():
    for _w in _seeds:
        add(Variant(f"bf16-trunc-site-{_mode}-warm{_w}", BF16, library=TRUNCATING,
                    site_rounding=_mode, warm_seed=_w, needs=("avx512_bf16",)))

# The start split (seedsplit-amd.md): on the AMD EPYC a fall went with the warm start, not the
# stream. A start is two draws of its seed: its initial weights and its supervised batches (with
# their noise). These keep the run's seed for all but the initial weights, drawn from another's.
# Then sym and nudge on the same sixteen starts: does a split start that fell under rne6 fall
# under the others? Do the split starts' falls cluster by start, as the seeds' own do?
SPLIT_INIT = {"rne6": (0, 14, 3, 11, 12, 13),  # AMD: 0, 14 the fragile; 3, 11-13 the held
              "sym": (0, 14, 3, 11, 12, 13),  # sym held on 3, 11-13 too
              "nudge": (0, 14, 3, 11, 12, 13)}  # nudge fell on 0, 14 and held on 3, 11-13
for _mode, _seeds in SPLIT_INIT.items():
    for _i in _seeds:
        add(Variant(f"bf16-trunc-site-{_mode}-init{_i}", BF16, library=TRUNCATING,
                    site_rounding=_mode, init_seed=_i, needs=("avx512_bf16",)))

def parse_run(name):
    """(arm, variant, seed) of a run folder's name, or None where it is not ARM-VARIANT-sSEED
    of a known arm and variant (the longest arm first: grpo-len20 before grpo)."""
    m = re.fullmatch(r"(.+)-s(\d+)", name)
    for arm in sorted(ARMS, key=len, reverse=True):
        if m and m.group(1).startswith(arm + "-") and m.group(1)[len(arm) + 1:] in VARIANTS:
            return arm, VARIANTS[m.group(1)[len(arm) + 1:]], int(m.group(2))
    return None

def variant_of(args):
    """The variant whose record a run's args.json holds, or None."""
    dial = (args["dial_dose"], args["dial_shape"]) if args.get("dial_dose") else None
    swap = (args["swap_from"], args["swap_step"]) if args.get("swap_from") else None
    seen = (args["dtype"], args.get("engine_dtype", args["dtype"]), args.get("lm_head", "same"),
            args.get("trainer_kernels", "torch"), args.get("kernel_library"),
            bool(args.get("amx_hidden")), bool(args.get("engine_custom_ops")), dial, swap,
            args.get("site_rounding", "rne"), args.get("embed_grad", "dtype"),
            args.get("attention_weights", "float32"), args.get("warm_seed"),
            args.get("init_seed"))
    return next((v for v in VARIANTS.values() if v.recorded() == seen), None)

def runs_on(v, isa):
    """Whether a chip with these ISA flags runs the variant."""
    return all(f in isa for f in v.needs) and not any(f in isa for f in v.lacks)
