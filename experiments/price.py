"""
experiments/price.py: the cheap fix's price, with its spread. One forward and backward of the
bf16 trainer over 512 teacher-forced held-out sequences (sites.teacher_forced), in four trainers
back to back in each round, each round starting one trainer later: plain bf16, the sites' hooks
alone (bf16-site-rne: torch's cast at the sites, no arithmetic changed), the cheap fix
(bf16-site-trunc; --mode another of sites.py's rules) and the engine's own kernels
(bf16-aligned). The first round warms up and is dropped. In each later round every trainer's
time is read over plain bf16's in that round, so drift between rounds cancels; the reading is
the median of those ratios over the rounds, with their quartiles:

    hooks        bf16-site-rne / bf16
    arithmetic   bf16-site-trunc / bf16-site-rne      (or bf16-site-MODE's)
    price        bf16-site-trunc / bf16

    python experiments/price.py --json results/MACHINE/price/0.9m-T.json           # 0.9M GPT
    python experiments/price.py --init CKPT --json results/MACHINE/price/7m-T.json  # another
    python experiments/price.py --mode sym --json results/MACHINE/price/0.9m-sym-T.json

Nothing may run beside it: on 2 cores a second job slows the trainers unevenly. A timing is a
chip's and a sitting's; only ratios within a file compare. sites.py --cost is the same timing
in every site mode, the median of three rounds. Page: experiments/price.md.
"""
import numpy as np

import common  # first: it puts the core on sys.path
import model
import sites
from instruments import machine

def trainers(mode="trunc"):
    """(name, site mode, trainer) a round: plain bf16, the hooks alone, `mode`, aligned."""
    return (("bf16", None, "bf16"), ("bf16-site-rne", "rne", "bf16"),
            (f"bf16-site-{mode}", mode, "bf16"), ("bf16-aligned", None, "bf16-aligned"))

TRAINERS = trainers()  # the cheap fix's

def time_rounds(gpt, idx, trainers, rounds):
    """{name: seconds in each of `rounds` rounds}: each (name, site mode, trainer) once a round,
    after a warm-up round, each round starting one trainer later (a trainer's place in the round
    weighs: price.md); the site mode installed for its trainer (sites.use)."""
    from mismatch import time_fwd_bwd  # mismatch imports the engine's side: only here

    times = {name: [] for name, _, _ in trainers}
    for r in range(rounds + 1):
        turn = r % len(trainers)
        for name, site_mode, trainer in [*trainers[turn:], *trainers[:turn]]:
            sites.use(site_mode)
            seconds = time_fwd_bwd(gpt, trainer, idx, "cpu")
            if r:  # round 0 is the warm-up
                times[name].append(seconds)
    sites.use(None)
    return times

def ratios(times, mode="trunc"):
    """Per round, each trainer over plain bf16, and the arithmetic (`mode` over the hooks
    alone): {reading: [median, first quartile, third quartile]} over the rounds."""
    t, site = {name: np.array(s) for name, s in times.items()}, f"bf16-site-{mode}"
    per_round = {f"{name} / bf16": s / t["bf16"] for name, s in t.items() if name != "bf16"}
    per_round[f"{site} / bf16-site-rne"] = t[site] / t["bf16-site-rne"]
    return {k: np.percentile(r, [50, 25, 75]).tolist() for k, r in per_round.items()}

def main(argv=None):
    from offline import refuse_bad_init

    p = common.parser("the cheap fix's price: the trainer's time in four trainers, per round")
    p.add_argument("--init", default=None, help="a checkpoint (default: seed's warm start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", default="trunc", choices=[m for m in sites.RULES if m != "rne"],
                   help="the rounding timed at the sites (default: the cheap fix's)")
    p.add_argument("--rounds", type=common.at_least(2), default=20,
                   help="rounds timed after the warm-up")
    p.add_argument("--json", default=None, help="also write the times and ratios here")
    args = p.parse_args(argv)
    common.writable(args.json)
    refuse_bad_init(args.init)
    idx, _ = sites.teacher_forced(args.seed)
    gpt = model.load_hf(args.init or sites.default_warm_start(args.seed), "cpu")
    times = time_rounds(gpt, idx, trainers(args.mode), args.rounds)
    out = ratios(times, args.mode)
    print(f"\nthe trainer's forward + backward, {args.rounds} rounds: median seconds; each "
          "trainer over plain bf16 in its round, median [quartiles]\n")
    for name, s in times.items():
        print(f"{name:16} {np.median(s):7.3f} s")
    for k, (mid, low, high) in out.items():
        print(f"{k:34} {mid:.3f} [{low:.3f}, {high:.3f}]")
    if args.json:
        init = {"checkpoint": args.init} if args.init else {}
        common.write_json(args.json, {"machine": machine(), "seed": args.seed, **init,
                                      "mode": args.mode, "rounds": args.rounds,
                                      "seconds": times, "ratios": out})
    return out

if __name__ == "__main__":
    main()
