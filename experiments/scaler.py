"""
experiments/scaler.py: why an fp16 trainer needs the GradScaler.

    python experiments/scaler.py --json figures/scaler.json

One real GRPO batch of the warm start (the fp16 engine's samples and advantages): its policy
gradient from the 16-bit trainer at several loss scales, against float32's. Unscaled, fp16's
backward flushes most tiny entries of the logits' gradient (a token mean over ~12,000 tokens)
to zero or a subnormal; 2**16 keeps more of them, and loses almost none of the weight
gradient; 2**24 overflows to inf. No figure: the table, and figures/scaler.json.
"""
import torch

import common  # first: it puts the core on sys.path
import task
from grpo import grpo_loss, loss_norm
from instruments import machine
from model import token_logprobs
from offline import base_parser, flat_grad, parse, rl_args, setup, underflow
from precision import INIT_SCALE, get_precision
from train_grpo import rollout  # the loop's step 1: a run's own batches

SCALES = [("bf16", 1.0), ("fp16", 1.0), ("fp16", 2.0**8), ("fp16", INIT_SCALE), ("fp16", 2.0**24)]

def gradients(model, batch, norm, name, scale, device):
    """(the logits' gradient, still scaled; the weights', unscaled in float32 as unscale_
    does) of the plain policy gradient (ratio 1), by the `name` trainer at loss x scale."""
    forward, seen = get_precision(name, device=device).logits_fn(model), {}

    def forward_keeping_logit_grad(x):
        logits = forward(x)
        logits.register_hook(lambda g: seen.update(logits=g))  # returns None: g goes on
        return logits

    logp = token_logprobs(forward_keeping_logit_grad, batch.idx)
    loss = grpo_loss(logp, logp.detach(), batch, norm)[0]
    g = flat_grad(model, loss * scale) / scale  # the backward fills seen["logits"]
    return seen["logits"], g

def scaler(args, engine=None):
    """The table: per trainer and scale, the shares flushed to 0 and the relative error."""
    ckpt, model, device, get_engine = setup(args, engine)
    train_batch = task.make_splits(args.seed, args.n_items, task.N_EVAL)[1]
    batch = rollout(get_engine("fp16"), train_batch, rl_args(args), 0, device)
    norm = loss_norm(batch.mask, "grpo", False, args.max_new_tokens)
    exact_logits, exact = gradients(model, batch, norm, "fp32", 1.0, device)
    rows = []
    for name, scale in SCALES:
        g_logits, g = gradients(model, batch, norm, name, scale, device)
        zero, sub = underflow(g_logits, exact_logits)
        finite = bool(torch.isfinite(g).all())
        error = ((g - exact).norm() / exact.norm()).item() if finite else None
        rows.append({"dtype": name, "loss_scale": scale, "finite": finite,
                     "logit_grad_zero": zero, "logit_grad_underflow": sub,
                     "weight_grad_zero": underflow(g, exact)[0], "rel_error": error})
    result = {"experiment": "scaler", "checkpoint": ckpt, "machine": machine(),
              "sequences": len(batch.adv), "tokens": int(batch.mask.sum()), "rows": rows}
    print_scaler(result)
    return result

def print_scaler(result):
    print(f"\nthe policy gradient of one GRPO batch ({result['sequences']} sequences, "
          f"{result['tokens']} tokens) on {result['checkpoint']}\n"
          f"{common.machine_line(result['machine'])}\nagainst float32's; of the entries non-zero "
          "there, the share stored as 0 (or as 0 or a subnormal)\n\n"
          f"{'trainer':8} {'scale':>9} {'logit grad 0':>13} {'0 or subn.':>11} "
          f"{'weight grad 0':>14} {'rel. error':>11}")
    for r in result["rows"]:
        err = f"{r['rel_error']:>11.2e}" if r["finite"] else f"{'overflow':>11}"
        print(f"{r['dtype']:8} {r['loss_scale']:>9.0f} {r['logit_grad_zero']:>13.1%} "
              f"{r['logit_grad_underflow']:>11.1%} {r['weight_grad_zero']:>14.2%} {err}")

def main(argv=None, engine=None):
    p = base_parser("why an fp16 trainer needs the GradScaler (the docstring)")
    p.add_argument("--rl-seed", type=int, default=0, help="the batch's prompts and sampling")
    p.add_argument("--batch-size", type=common.at_least(1), default=64, help="prompts in the batch")
    args = parse(p, argv)
    return common.finish(args, scaler(args, engine))

if __name__ == "__main__":
    main()
