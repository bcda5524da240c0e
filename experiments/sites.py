"""
experiments/sites.py: the trainer's own rounding at the two sites where vLLM's CPU kernels
truncate (rounding.md): the rotary embedding's output and the attention's output. Each is a
float32 result rounded to bf16; the trainer (model.apply_rope, precision.TensorCoreMatmuls)
rounds it to nearest even. Here it can round another way, the backward straight through (as a
cast's: the gradient cast back to float32, unchanged):

    mode        rounds the float32 result to bf16                mean error        mean |error|
    rne         to nearest, ties to even (the trainer's own)     0                 1/4 ulp
    trunc       toward zero (vLLM's _C_AVX2, _C_AVX512)          -1/2 ulp (size)   1/2 ulp
    away        away from zero                                   +1/2 ulp (size)   1/2 ulp
    rne6        to nearest at 6 kept mantissa bits               0                 1/2 ulp
    sym         toward zero or away, by a hash of the value      0                 1/2 ulp
    rne5        to nearest at 5 kept mantissa bits               0                 1 ulp
    nudge       to nearest, pushed 1/4 ulp either way by hash    0                 5/16 ulp
    nudge8      to nearest, pushed 1/8 ulp either way by hash    0                 17/64 ulp
    nudge16     to nearest, pushed 1/16 ulp either way by hash   0                 65/256 ulp
    nudge3of16  to nearest, pushed 3/16 ulp either way by hash   0                 73/256 ulp
    nudge3of8   to nearest, pushed 3/8 ulp either way by hash    0                 25/64 ulp
    nudge7of16  to nearest, pushed 7/16 ulp either way by hash   0                 113/256 ulp
    truncpm     toward zero, then 1 ulp up or down by hash       -1/2 ulp (size)   1 ulp
    truncpm2    toward zero, then 2 ulp up or down by hash       -1/2 ulp (size)   2 ulp
    trunc1of2   toward zero at half the values by hash, else rne -1/4 ulp (size)   3/8 ulp
    trunc1of4   toward zero at a quarter of them by hash, else rne -1/8 ulp (size)  5/16 ulp

and modes that leave the two sites at rne and round elsewhere, where the engine's linears round
to nearest too (AT_MATMULS): nudge-matmuls, nudge's rule at the output of every matmul of the
16-bit trainer but the attention's (the blocks' linears and the LM head; matmulnudge.md), and
nudge-head and sym-head, nudge's and sym's rule at the LM head's output alone: the logits
moved, nothing before them, and nudge-blocks, nudge's at every one but the head's
(headnudge.md). The head is found by its weight (marked_forward). How far each mode moves the
trainer's log-probs from rne's: redraw.py.

(ulp: bf16's unit in the last place at the value; the means over uniformly spread low bits.)
So the four after rne have the same mean |error| at the op, and only the sign's structure
differs: trunc and away one-signed in size, rne6 and sym zero-mean. rne5 is a size dial:
zero-mean at twice their error, for where one-signed errors add up to a larger token mismatch
than zero-mean ones of the same size at the op (the 7M GPT, scale-rne5.md). nudge is the neutral
change (symredraw.md): rne's rule, a quarter of the values a step the other way (those within
1/4 ulp of a tie, pushed across it by the coin), so 1.25x rne's error: the trainer's path drawn
again at about its own error size. A push of p ulp moves a share p of the values and adds p^2
ulp to the mean |error|: its doses, nudge8 and nudge16, move 1/8 and 1/16 of them at 1.06x and
1.016x rne's error (nudgedose.md), nudge3of16 3/16 of them at 1.14x (nudgedose316.md), nudge3of8
and nudge7of16 3/8 and 7/16 of them at 1.56x and 1.77x (nudgedose-amd.md). truncpm and truncpm2
keep truncation's one-signed error and add a zero-mean step: against a truncating engine, the
cheap fix's sign with a larger mismatch (truncpm-amd.md). Zero, values below the step and
infinities do not move (no step crosses zero or into NaN). trunc1of2 and trunc1of4 are the cheap
fix's doses: its rule at half or a quarter of the values, rne's at the rest (truncdose-amd.md).

    python experiments/campaign.py --arms gspo-engine --variants bf16-site-trunc --seeds 0 1

install(mode) sets it for the process, as rounding.load sets vLLM's library: the 16-bit trainer
(TensorCoreMatmuls, strict) rounds its attention output in `mode`, and model.apply_rope its
output while that trainer runs; the warm start (not strict) and float32 are untouched. Variants
name it in their record (variants.py: site_rounding); campaign.py --run installs it. NaN stays
NaN (quiet), infinities stay infinite. The cheap fix's price, a timing (the campaign paused):

    python experiments/sites.py --cost --json results/MACHINE/sites/cost.json

(--init CKPT: another checkpoint's price; price.py: one mode's, over 20 rounds, the spread.)

Where each mode's error grows in the trainer, block by block, against float32 (no engine):

    python experiments/sites.py --layers --init CKPT --json results/MACHINE/scale-sites/layers.json

and, with --engine, how it combines with the engine's own (the aligned trainer on the library
loaded, --library to force one): d block by block, the share of the two errors that cancels,
and the answer tokens' log-prob mismatch, the last link, where the policy's unsure positions
weigh most:

    python experiments/sites.py --layers --engine --init CKPT --json F

in the modes of the readings committed (LAYER_MODES), or --modes, rne and trunc among them.

Page: experiments/sites.md.
"""
import torch
from torch.utils._pytree import tree_leaves, tree_map

import common  # first: it puts the core (model.py, precision.py) on the path
import model
import precision
import rounding
from variants import (AT_MATMULS, NUDGE_PUSH, SITE_MODES, SITE_ROUNDING as MODES, TRUNC_SHARE,
                      TRUNC_STEP)

LOW = 0xFFFF  # the 16 bits a bf16 drops from a float32
KEPT = {"rne6": 6, "rne5": 5}  # the to-nearest modes' kept mantissa bits (a bf16 keeps 7)
HASH = 0x9E3779B1 - 2 ** 32  # Knuth's multiplicative hash, the signed int32 of its pattern
# the push in the 16 dropped bits, whose range is one ulp (a quarter: 0x4000), exact for these
NUDGE = {mode: int(push * (LOW + 1)) for mode, push in NUDGE_PUSH.items()}
STEP = {mode: step * (LOW + 1) for mode, step in TRUNC_STEP.items()}  # truncpm's, in the pattern
SHARE = {mode: int(p * (LOW + 1)) for mode, p in TRUNC_SHARE.items()}  # of the hash's top 16 bits
EXPONENT = 0x7F800000  # an all-ones exponent: infinity or NaN
RULES = tuple(m for m in MODES if m not in AT_MATMULS)  # round_to_bf16's; the rest are places
LAYER_MODES = ("rne", *SITE_MODES, "rne5")  # --layers' modes unless --modes: its readings'
ACTIVE = []  # the mode while the 16-bit trainer runs (SiteRounding); empty: rne everywhere
HEADS = []  # the LM head's weight while a GPT's forward runs (marked_forward)

def coin(bits):
    """sym's, nudge's and truncpm's coin: the top bit of the pattern times HASH (int32's product
    wraps to the low 32 bits: the top bit set is a negative product), half each way."""
    return bits * HASH < 0

def to_nearest(bits, drop):
    """A bit pattern rounded to nearest at `drop` dropped low bits, ties to even."""
    lsb = (bits >> drop) & 1
    return (bits + (1 << (drop - 1)) - 1 + lsb) & ~((1 << drop) - 1)

def round_bits(x, mode):
    """float32 -> float32 holding a bf16 value, rounded in `mode` on the int32 bit pattern
    (sign-magnitude: adding grows the magnitude); the adds wrap at 32 bits (price.md)."""
    bits = x.float().contiguous().view(torch.int32)
    if mode == "trunc":  # the cheap fix: an and, nothing carries
        bits = bits & ~LOW
    elif mode in KEPT:  # drop 23 - kept bits to nearest: a bf16, its last bits 0
        bits = to_nearest(bits, 23 - KEPT[mode])
    elif mode in NUDGE:  # +-the push, then to nearest, ties to even: still a bf16 neighbour
        push = NUDGE[mode]
        bits = to_nearest(torch.where(coin(bits), bits + push, bits - push), 16)
    elif mode in STEP:  # toward zero, then the step up or down in size by the coin
        step, low = STEP[mode], bits & ~LOW
        size = low & 0x7FFFFFFF
        moves = (size >= step) & (size < EXPONENT)  # never across zero, never off infinity
        stepped = torch.where(coin(bits), low + step, low - step)
        bits = torch.where(moves, stepped, low)
    elif mode in SHARE:  # truncation where the hash's top 16 bits fall below the share, else rne
        cut = ((bits * HASH) >> 16 & LOW) < SHARE[mode]
        bits = torch.where(cut, bits & ~LOW, to_nearest(bits, 16))
    elif mode in ("away", "sym"):  # up one bf16 step wherever a low bit is set; sym: half
        up = (bits & LOW) != 0
        if mode == "sym":
            up &= coin(bits)
        bits = torch.where(up, (bits & ~LOW) + (LOW + 1), bits & ~LOW)
    else:  # rne is torch's cast; a matmul mode names where its rule acts, not a rule
        raise ValueError(f"round_bits: no rule {mode!r}")
    # NaN in, quiet NaN out: an add could carry a payload off, truncation make it infinite
    return bits.view(torch.float32).masked_fill_(x.isnan(), float("nan"))

def round_to_bf16(x, mode):
    """A float32 tensor rounded to bf16 in `mode` (rne: torch's cast)."""
    if mode == "rne":
        return x.to(torch.bfloat16)
    return round_bits(x, mode).to(torch.bfloat16)  # exact: the value already is a bf16

class RoundAt(torch.autograd.Function):
    """The forward rounds in a mode; the backward is a cast's: the gradient, back in float32."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.dtype = x.dtype
        return round_to_bf16(x, mode)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None

def site(x32, dtype):
    """A site's float32 result in the trainer's dtype: the active mode's rounding in bf16."""
    if ACTIVE and ACTIVE[-1] not in AT_MATMULS and dtype == torch.bfloat16:
        return RoundAt.apply(x32, ACTIVE[-1])
    return x32.to(dtype)

def apply_rope(x, cos, sin):  # model.apply_rope, its rounding at the site
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return site(x.float() * cos + rotated.float() * sin, x.dtype)

class SiteRounding(precision.TensorCoreMatmuls):
    """TensorCoreMatmuls with the attention's output rounded in the mode, and the mode
    active for apply_rope while the strict (16-bit trainer's) forward runs."""
    mode = "rne"

    def __enter__(self):
        ACTIVE.extend([self.mode] * self.strict)
        return super().__enter__()

    def __exit__(self, *exc):
        del ACTIVE[len(ACTIVE) - self.strict:]
        return super().__exit__(*exc)

    def at_matmul(self, func, args):
        """Whether the mode rounds this matmul's output: every one, the LM head's alone, or
        every one but the head's."""
        if self.mode not in AT_MATMULS or func not in precision.MATMULS:
            return False
        head = bool(func is torch.nn.functional.linear and HEADS and args[1] is HEADS[-1])
        where = AT_MATMULS[self.mode][1]
        return where == "every" or head == (where == "head")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        sdpa = func is torch.nn.functional.scaled_dot_product_attention
        at_matmul = self.at_matmul(func, args)
        rounded = sdpa or (at_matmul and self.dtype == torch.bfloat16)
        if not (rounded and self.strict) or all(t.dtype == torch.float32 for t in tensors):
            return super().__torch_function__(func, types, args, kwargs)

        def to_f32(t):  # the parent's: inputs rounded to the dtype, computed in float32
            is_float = isinstance(t, torch.Tensor) and t.is_floating_point()
            return t.to(self.dtype).float() if is_float else t

        args, kwargs = tree_map(to_f32, (args, kwargs or {}))
        if sdpa:  # the attention's output, a site: the mode's rounding there (rne elsewhere)
            return site(func(*args, **kwargs), self.dtype)
        return RoundAt.apply(func(*args, **kwargs), AT_MATMULS[self.mode][0])

def marked_forward(self, *args, **kwargs):  # model.GPT.forward, its head's weight marked
    HEADS.append(self.lm_head.weight)  # under functional_call: the 16-bit copy the head uses
    try:
        return ORIGINAL["forward"](self, *args, **kwargs)
    finally:
        HEADS.pop()

def install(mode):
    """The trainer's rounding at the two sites, for this process (one mode a process)."""
    if mode not in MODES:
        raise ValueError(f"site rounding {mode}: one of {', '.join(MODES)}")
    SiteRounding.mode = mode
    precision.TensorCoreMatmuls = SiteRounding  # logits_fn reads the name at each call
    model.apply_rope = apply_rope  # Attention.forward reads the name at each call
    model.GPT.forward = marked_forward  # the head found by its weight, whatever its shape
    return mode

ORIGINAL = {"trainer": precision.TensorCoreMatmuls, "rope": model.apply_rope,
            "forward": model.GPT.forward}

def use(mode):
    """install(mode), or with None the trainer as it is (the original names back)."""
    if mode is None:
        precision.TensorCoreMatmuls, model.apply_rope = ORIGINAL["trainer"], ORIGINAL["rope"]
        model.GPT.forward = ORIGINAL["forward"]
        return None
    return install(mode)

def teacher_forced(seed, n_items=12):
    """(idx, mask) of seed's 256 held-out problems with their answers, twice (512 sequences):
    the trainer on fixed tokens, no engine (train_grpo's default task, budget 2 x 12 + 8)."""
    import task
    problems = task.make_splits(seed, n_items, task.N_EVAL)[0] * 2
    return model.pack([task.prompt_ids(p) for p, _ in problems],
                      [task.answer_ids(a) for _, a in problems], "cpu")[:2]

def layers(ckpt, seed=0, engine=False, modes=LAYER_MODES):
    """Where each mode's error grows: the bf16 trainer's RMS error against float32 over RMS
    after each block, the final norm and the logits (offline.layer_errors' measure), in each of
    modes, on seed's teacher-forced held-out sequences of a checkpoint: {"fp32": {mode: errors}}.
    It asks whether a one-signed error adds up over the blocks faster than a zero-mean one of
    its size at the op. With engine, how the trainer's error combines with the engine's: the
    engine's own (the aligned trainer: its kernels, the library loaded) against float32, and
    each mode's difference from it, d, both over float32's RMS, so that at each layer
    d^2 = e_trainer^2 + e_engine^2 - 2 rho e_trainer e_engine (rho: how much of their errors
    they share; combined())."""
    from offline import activations, relative

    idx, mask = teacher_forced(seed)
    gpt = model.load_hf(ckpt, "cpu")
    use(None)
    fp32 = activations(gpt, "fp32", idx, "cpu")
    ref = activations(gpt, "bf16-aligned", idx, "cpu") if engine else None
    out = {"fp32": {}, "engine": {}, "tokens": {}} if engine else {"fp32": {}}
    for mode in modes:
        use(None if mode == "rne" else mode)
        trainer = activations(gpt, "bf16", idx, "cpu")
        out["fp32"][mode] = relative(trainer, fp32, mask)
        if engine:
            out["engine"][mode] = relative(trainer, ref, mask, fp32)
            out["tokens"][mode] = tokens(trainer[-1], ref[-1], idx, mask)
    use(None)
    if engine:
        out["engine_error"] = relative(ref, fp32, mask)
    return out

TOP = 0.01  # tokens(): the share of the mismatch in this fraction of positions, its largest

def tokens(logits, ref, idx, mask):
    """The last link, logits to the answer token's log-prob (log-softmax in float64: the
    differences are 1e-4 of values near 0), against ref's: mean |d| a token, the share of its
    sum in the TOP of positions where it is largest, and mean |d| of the token's logit margin
    over ref's runner-up (every position weighted alike, where d weights each by how unsure
    the policy is there: d ~ p(runner-up) x the margin's error when p(token) ~ 1)."""
    def at(z, tok):  # z at each answer position's token
        return z.gather(-1, tok.unsqueeze(-1)).squeeze(-1)[mask.bool()]

    logits, ref, target = logits.double(), ref.double(), idx[:, 1:]
    top2 = ref.topk(2, dim=-1).indices
    runner = torch.where(top2[..., 0] == target, top2[..., 1], top2[..., 0])
    d = (at(ref.log_softmax(-1), target) - at(logits.log_softmax(-1), target)).abs()
    margin = (at(ref, target) - at(ref, runner)) - (at(logits, target) - at(logits, runner))
    top = d.sort(descending=True).values[:max(1, round(TOP * len(d)))]
    return {"mean_abs": d.mean().item(), "top_share": (top.sum() / d.sum()).item(),
            "margin_abs": margin.abs().mean().item()}

def combined(e_trainer, e_engine, d):
    """rho at each layer: the share of the two errors that cancels in d (1: the same error on
    both sides, d = 0 if also the same size; 0: independent, d^2 the sum of the squares)."""
    return [(t * t + e * e - x * x) / (2 * t * e) for t, e, x in zip(e_trainer, e_engine, d)]

def cost(seed=0, ckpt=None, rounds=4):
    """The cheap fix's price: seconds of one forward + backward of the bf16 trainer on 512
    teacher-forced held-out sequences of seed's warm start or ckpt, as it is, with each of plan
    sites' four modes, with rne (the hooks alone) and on the engine's kernels (aligned); rounds
    after a warm-up, each starting one mode later (price.time_rounds), the median of the rest."""
    from price import time_rounds

    idx, _ = teacher_forced(seed)
    gpt = model.load_hf(ckpt or default_warm_start(seed), "cpu")
    site_modes = [(f"bf16-site-{m}", m, "bf16") for m in ("rne", *SITE_MODES)]
    trainers = [("bf16", None, "bf16"), *site_modes, ("bf16-aligned", None, "bf16-aligned")]
    times = time_rounds(gpt, idx, trainers, rounds - 1)  # rounds counts the warm-up here
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}

def default_warm_start(seed, n_items=12):
    """seed's warm start of the default GPT (trained unless cached, as train_grpo.py would)."""
    from warm_start import model_config, warm_start
    return warm_start(model_config(n_items, 2 * n_items + 8), n_items, seed, "cpu")

def print_layers(errors):
    n = len(errors["rne"])
    print(f"\nthe bf16 trainer against float32, RMS error / RMS: blocks 1-{n - 2}, the final "
          "norm, the logits; each mode's over trunc's in the last block\n")
    for mode, e in errors.items():
        print(f"{mode:7} {' '.join(f'{x:.2e}' for x in e)}  {e[-3] / errors['trunc'][-3]:.2f}x")

def print_engine(out, library):
    """d (trainer minus engine) layer by layer, and rho in the last block."""
    e_engine, d = out["engine_error"], out["engine"]
    print(f"\nthe engine's kernels ({library}) against float32:\n"
          f"engine  {' '.join(f'{x:.2e}' for x in e_engine)}\n\nd, the bf16 trainer against the "
          "engine's kernels, RMS / float32's RMS; in the last block its size over trunc's, and "
          "rho (the share of the errors that cancels)\n")
    for mode, x in d.items():
        rho = combined(out["fp32"][mode], e_engine, x)[-3]
        print(f"{mode:7} {' '.join(f'{v:.2e}' for v in x)}  {x[-3] / d['trunc'][-3]:.2f}x  "
              f"rho {rho:+.3f}")
    t, trunc = out["tokens"], out["tokens"]["trunc"]
    print(f"\nthe answer tokens' log-probs against the engine's kernels: mean |d| a token, the "
          f"share of it in the {TOP:.0%} of positions where it is largest, the runner-up margin's "
          "mean |d|; each over trunc's\n")
    for mode, r in t.items():
        print(f"{mode:7} {r['mean_abs']:.3e} ({r['mean_abs'] / trunc['mean_abs']:.2f}x)  "
              f"top {r['top_share']:.2f}  margin {r['margin_abs']:.3e} "
              f"({r['margin_abs'] / trunc['margin_abs']:.2f}x)")

def read_layers(args, host):
    """--layers: the reading printed, and written with --json (the engine's keys with --engine)."""
    library = rounding.load(args.library) if args.engine else None  # before any engine op
    ckpt = args.init or default_warm_start(args.seed)
    out = layers(ckpt, args.seed, args.engine, args.modes)
    print_layers(out["fp32"])
    if args.engine:
        print_engine(out, library)
    engine = {"kernel_library": library,
              **{k: out[k] for k in ("engine_error", "engine", "tokens")}} if args.engine else {}
    if args.json:
        common.write_json(args.json, {"experiment": "sites-layers", "machine": host,
                                      "checkpoint": ckpt, "seed": args.seed,
                                      "layers": out["fp32"], **engine})
    return out

def main(argv=None):
    from instruments import machine

    p = common.parser("the cheap fix's price, or where each site mode's error grows")
    p.add_argument("--cost", action="store_true", help="time forward + backward, each mode")
    p.add_argument("--layers", action="store_true", help="each mode's error after each block")
    p.add_argument("--init", default=None, help="a checkpoint (default: seed's warm start)")
    p.add_argument("--engine", action="store_true",
                   help="--layers: also against the engine's kernels (the aligned trainer)")
    p.add_argument("--library", choices=list(rounding.LIBRARIES), default=None,
                   help="--engine: force this vLLM kernel library (rounding.py)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=LAYER_MODES,
                   help="--layers: these modes, rne and trunc among them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the times (errors) here")
    args = p.parse_args(argv)
    common.writable(args.json)
    if (args.engine or args.library) and not args.layers:
        common.refuse("--engine and --library go with --layers")
    if not {"rne", "trunc"} <= set(args.modes):
        common.refuse("--modes: rne and trunc among them (each mode is read against trunc)")
    if args.library and not args.engine:
        common.refuse("--library: the engine's kernels are read only with --engine")
    rounding.refuse_unrunnable(args.library)
    from offline import refuse_bad_init  # offline imports this module: here, not at the top
    refuse_bad_init(args.init)
    if args.layers:
        return read_layers(args, machine())
    if not args.cost:
        common.refuse("nothing to do: --cost or --layers (otherwise a module: install(mode))")
    seconds = cost(args.seed, args.init)
    for name, s in seconds.items():
        print(f"{name:18} {s:6.3f} s  {s / seconds['bf16']:5.2f}x bf16's")
    if args.json:  # the checkpoint only when named: the default's files keep their keys
        init = {"checkpoint": args.init} if args.init else {}
        common.write_json(args.json, {"machine": machine(), "seed": args.seed, **init,
                                      "trainer_fwd_bwd_s": seconds})

if __name__ == "__main__":
    main()
