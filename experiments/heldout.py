"""
experiments/heldout.py: a policy's held-out accuracy, read the same way for every run.

    python experiments/heldout.py --init runs/campaign/RUN/hf --seed S --json RUN/heldout.json

One fp32 engine reads every policy, whatever dtype trained it (each run's own engine reads
identical weights differently): --samples of every held-out problem at temperature 1, the same
random numbers for every policy of a seed (paired); the s.e. is over problems (ddof 1).
campaign.py runs it on each finished run; campaign_figure.py and dial_figure.py read it.
"""
import math

import numpy as np
import torch

import common  # first: it puts the core on sys.path
import task
from instruments import machine
from offline import base_parser, parse, setup
from rollout import generate

def heldout(args, engine=None):
    ckpt, model, device, get_engine = setup(args, engine)
    problems = task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    torch.manual_seed(task.seed_of("heldout", args.seed))
    prompts = [task.prompt_ids(p) for p, _ in problems]
    samples = generate(get_engine("fp32"), prompts, args.samples, args.max_new_tokens, task.EOS_ID)
    answers = [a for _, a in problems for _ in range(args.samples)]
    right = np.array([task.reward(s.response_ids, a) for s, a in zip(samples, answers)])
    per_problem = right.reshape(len(problems), args.samples).mean(1)
    result = {"experiment": "heldout", "checkpoint": ckpt, "machine": machine(),
              "problems": len(problems), "samples_per_problem": args.samples,
              "accuracy": float(per_problem.mean()),
              "se": float(per_problem.std(ddof=1) / math.sqrt(len(problems)))}
    print(f"held-out accuracy of {ckpt} (fp32 engine, {len(problems)} problems x "
          f"{args.samples}): {result['accuracy']:.4f} +- {result['se']:.4f}")
    return result

def main(argv=None, engine=None):
    p = base_parser("a policy's held-out accuracy, by one fp32 engine")
    p.add_argument("--samples", type=common.at_least(1), default=8, help="samples of each problem")
    args = parse(p, argv)
    return common.finish(args, heldout(args, engine))

if __name__ == "__main__":
    main()
