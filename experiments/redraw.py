"""
experiments/redraw.py: how far a change of the trainer's rounding moves the log-probs GSPO reads.

A rounding mode of sites.py (at the two sites, at every matmul, at the LM head alone) that the
engine does not share redraws the trainer's side of the log-ratio log mu - log pi. Its size,
with no engine: the plain bf16 trainer (rne) and the trainer in each mode, on seed's
teacher-forced held-out sequences (sites.teacher_forced: 256 problems with their answers,
twice), the answer tokens compared (sites.tokens):

    mean |d|         mean |log pi_mode - log pi_rne| over answer tokens (float64 log-softmax)
    margin           mean |change of the token's logit margin over rne's runner-up|
    top              the share of the sum of |d| in the 1 % of positions where it is largest

mean |d| weights each position by how unsure the policy is there (d ~ p(runner-up) x the
margin's change when p(token) ~ 1); the margin weights every position alike.

    python experiments/redraw.py --modes rne trunc sym nudge nudge-matmuls sym-head \\
        --json results/MACHINE/headnudge/redraw.json

Deterministic on one machine (the trainer's emulated 16-bit kernels are torch's); a reading,
not a run: it says which changes are of one size, before runs ask what each does. Page:
experiments/headnudge.md. Left out: the engine (sites.py --layers --engine reads the trainer
against it) and any backward.
"""
import common  # first: it puts the core (model.py, precision.py) on the path
import model
import sites
from offline import activations, refuse_bad_init


def redraw(ckpt, seed=0, modes=sites.LAYER_MODES):
    """{mode: sites.tokens() of the mode's trainer against the plain one} for each mode but rne,
    on seed's teacher-forced held-out sequences of a checkpoint; the trainer restored after."""
    idx, mask = sites.teacher_forced(seed)
    gpt = model.load_hf(ckpt, "cpu")
    sites.use(None)
    plain = activations(gpt, "bf16", idx, "cpu")[-1]  # the logits, float32 copies
    out = {}
    for mode in modes:
        if mode != "rne":
            sites.use(mode)
            out[mode] = sites.tokens(activations(gpt, "bf16", idx, "cpu")[-1], plain, idx, mask)
    sites.use(None)
    return out


def main(argv=None):
    from instruments import machine

    p = common.parser("how far each rounding mode moves the trainer's log-probs from rne's")
    p.add_argument("--modes", nargs="+", choices=sites.MODES, required=True,
                   help="sites.py's modes, trunc among them (each is also read over trunc's)")
    p.add_argument("--init", default=None, help="a checkpoint (default: seed's warm start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the reading here")
    args = p.parse_args(argv)
    common.writable(args.json)
    if "trunc" not in args.modes:
        common.refuse("--modes: trunc among them (each mode is read over trunc's)")
    refuse_bad_init(args.init)
    ckpt = args.init or sites.default_warm_start(args.seed)
    out = redraw(ckpt, args.seed, args.modes)
    trunc = out["trunc"]
    print("\nthe answer tokens' log-probs, each mode's trainer against the plain one (rne): "
          "mean |d| a token, the top 1 %'s share, the runner-up margin's mean |d|; each over "
          "trunc's\n")
    for mode, r in out.items():
        print(f"{mode:13} {r['mean_abs']:.3e} ({r['mean_abs'] / trunc['mean_abs']:.2f}x)  "
              f"top {r['top_share']:.2f}  margin {r['margin_abs']:.3e} "
              f"({r['margin_abs'] / trunc['margin_abs']:.2f}x)")
    if args.json:
        common.write_json(args.json, {"experiment": "redraw", "machine": machine(),
                                      "checkpoint": ckpt, "seed": args.seed, "redraw": out})
    return out


if __name__ == "__main__":
    main()
