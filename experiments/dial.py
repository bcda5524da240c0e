"""
experiments/dial.py: the mismatch dial. A controlled mismatch on top of the trainer that has none.

    python experiments/dial.py calibrate --json results/MACHINE/dial.json   # the unit, per chip
    python experiments/dial.py calibrate --extend --json results/MACHINE/dial.json  # new shapes
    python experiments/dial.py doses --json results/MACHINE/dial.json  # each shape's s at 1x-10x

The bf16 trainer on the engine's kernels (--trainer-kernels engine) computes exactly the
engine's log-probs: mismatch 0. The dial adds noise to the engine's logits inside vLLM, with a
logits processor, and asks vLLM for the processed log-probs (logprobs_mode
"processed_logprobs"): the engine samples from the perturbed distribution mu and returns
log mu, the distribution it actually sampled from. The trainer never sees the noise. So a run
at dose D starts from dose 0's weights, kernels and prompts; what differs is the mismatch and,
since the noise is drawn from the sampler's own generator, the random numbers the engine
samples with: a dosed run draws other samples than dose 0's from its first step on.

Why a logits processor and not perturbed weights: the noise is then exactly the mismatch (no
second path through the network), its size is set directly, and vLLM's CPU engine runs it.

Four shapes, each set by one number s (drawn from torch's generator, which
train_grpo.rollout seeds every step):
  uniform      Gaussian noise of std s on every entry's logit, fresh at every position;
  bf16         the same, each entry's std scaled by the chip's measured bf16 mismatch in
               its bucket of pi (common.PI_EDGES): larger where pi is small, as bf16's is;
  temperature  no noise: the logits times (1 - s), an engine flatter than the trainer, a
               bias of one sign (what a flatter attention would make);
  persistent   noise of std s drawn once a sequence and held at all its positions: an
               error that does not average away along the sequence.
At dose 0 nothing is installed: the engine is exactly the aligned run's.

The unit of dose is the practitioners': the mean |log mu - log pi| per sampled token on the
warm start. 1x is the chip's plain bf16 (engine and trainer both bf16, no aligned kernels);
`calibrate` measures it, and for each shape how the std maps onto it.
"""

import json
import math

import numpy as np
import torch
from vllm.v1.sample.logits_processor import LogitsProcessor, MoveDirectionality

import common  # first: it puts the core on sys.path
import task
from common import PI_EDGES
from instruments import machine, pi_buckets
from variants import DIAL_SHAPES as SHAPES
from model import hf_named_tensors, load_hf, pack, token_logprobs
from precision import get_precision, mismatch_metrics
from rollout import generate, start_engine, sync_weights
from warm_start import model_config, warm_start

SIGMAS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 0.5, 1.0, 2.0)  # the grid of logit stds
DELTAS = (1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 0.6)  # temperature's: below 1
# What the processor reads: set by configure() before the engine samples (one process).
DIAL = {"sigma": 0.0, "shape": "uniform", "profile": None}

class DialProcessor(LogitsProcessor):
    """Adds the dial's noise to every row of the engine's float32 logits, before sampling."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.held = {}  # persistent: a batch row's noise, for its sequence's life

    def is_argmax_invariant(self):
        return False  # it changes which token is likeliest

    def update_state(self, batch_update):
        """persistent: follow each sequence's row (vLLM's order: removed, added, moved)."""
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.held.pop(row, None)
        for row, *_ in batch_update.added:
            self.held[row] = None  # a new sequence: its noise drawn at its first position
        for a, b, how in batch_update.moved:
            if how == MoveDirectionality.SWAP:
                self.held[a], self.held[b] = self.held.get(b), self.held.get(a)
            else:
                self.held[b] = self.held.pop(a, None)

    def apply(self, logits):
        if DIAL["sigma"] == 0.0:
            return logits
        if DIAL["shape"] == "temperature":  # flatter by (1 - s), every row alike
            return logits * (1.0 - DIAL["sigma"])
        if DIAL["shape"] == "persistent":
            return logits + DIAL["sigma"] * self.rows(logits)
        std = torch.full_like(logits, DIAL["sigma"])
        if DIAL["shape"] == "bf16":  # the std of each entry by its bucket of pi
            std = std * bucket_scale(logits.softmax(-1), DIAL["profile"])
        return logits + std * torch.randn(logits.shape, dtype=logits.dtype)

    def rows(self, logits):
        """Each row's held standard-normal noise, drawn in row order where new."""
        for row in range(logits.shape[0]):
            if self.held.get(row) is None:
                self.held[row] = torch.randn(logits.shape[1], dtype=logits.dtype)
        return torch.stack([self.held[row] for row in range(logits.shape[0])])

def bucket_scale(probs, profile):
    """Each entry's scale: the profile's value in its bucket of pi (PI_EDGES, the last holds 1)."""
    edges = torch.tensor(PI_EDGES[1:-1], dtype=probs.dtype)
    return torch.tensor(profile, dtype=probs.dtype)[torch.bucketize(probs, edges, right=True)]

def configure(sigma, shape="uniform", profile=None):
    if shape not in SHAPES:
        raise ValueError(f"dial shape {shape!r}: one of {SHAPES}")
    DIAL.update(sigma=float(sigma), shape=shape, profile=profile)

def engine_args(sigma):
    """start_engine's extra arguments: the processor and processed log-probs, or none at 0."""
    if sigma == 0:
        return {}
    return {"logits_processors": [DialProcessor], "logprobs_mode": "processed_logprobs"}

def sigma_for(calibration, shape, dose):
    """The logit std that gives `dose` x the chip's bf16 mismatch on the warm start:
    log-log interpolation of the calibration grid (mean |d| grows with the std)."""
    if dose == 0:
        return 0.0
    target = dose * calibration["unit"]
    grid = np.array(calibration["grid"][shape])  # rows: sigma, mean |d|
    s, m = np.log(grid[:, 0]), np.log(grid[:, 1])
    if not m[0] <= math.log(target) <= m[-1]:
        raise ValueError(
            f"dose {dose} ({target:.2e} a token) is outside {shape}'s calibrated "
            f"range {grid[0, 1]:.2e} to {grid[-1, 1]:.2e}"
        )
    return float(np.exp(np.interp(math.log(target), m, s)))

def dial_run_args(calibration_path, shape, dose):
    """(start_engine's extra arguments, args.json's record) for a run at `dose`."""
    calibration = json.load(open(calibration_path))
    sigma = sigma_for(calibration, shape, dose)
    configure(sigma, shape, calibration["profile"])
    record = {
        "dial_dose": dose,
        "dial_shape": shape,
        "dial_sigma": sigma,
        "dial_target_logp_abs_mean": dose * calibration["unit"],
        "dial_calibration": calibration_path,
    }
    return engine_args(sigma), record

def measure(llm, model, prompts, args, trainer):
    """Mean |log mu - log pi| per sampled token: the engine's samples of the held-out prompts,
    pi by `trainer` (a Precision) on the same tokens; also by bucket of pi."""
    torch.manual_seed(task.seed_of("dial", args.seed))
    samples = generate(llm, prompts, args.group_size, args.max_new_tokens, task.EOS_ID)
    columns = [[getattr(s, k) for s in samples] for k in ("prompt_ids", "response_ids")]
    idx, mask, mu = pack(*columns, "cpu", [s.logprobs for s in samples])
    with torch.no_grad():
        pi = token_logprobs(trainer.logits_fn(model), idx)
    return {**mismatch_metrics(mu, pi, mask), **pi_buckets(mu, pi, mask)}

def calibrate(args, old=None):
    """On the warm start: the unit (plain bf16's mean |d|, its bucket profile), fp16's for
    reference, and for each shape the mean |d| at each logit std of SIGMAS, the trainer on the
    engine's kernels (which alone sees no mismatch). With `old` (--extend) its unit and
    grids stay as they are and only the shapes it lacks are measured (a new shape, same unit)."""
    device = "cpu"
    cfg = model_config(args.n_items, args.max_new_tokens)
    ckpt = warm_start(cfg, args.n_items, args.seed, device)
    model = load_hf(ckpt).eval()
    prompts = [
        task.prompt_ids(p) for p, _ in task.make_splits(args.seed, args.n_items, task.N_EVAL)[0]
    ]
    result = old or plain_unit(ckpt, model, prompts, args, cfg)
    # One more bf16 engine with the processor: DIAL decides what it does, call by call.
    dialed = start_engine(ckpt, "bfloat16", args.seed, cfg.max_seq_len, **engine_args(1.0))
    aligned = get_precision("bf16", device=device, kernels="engine")
    unit, grid = result["unit"], result["grid"]
    for shape in [s for s in SHAPES if s not in grid]:
        grid[shape] = []
        for sigma in DELTAS if shape == "temperature" else SIGMAS:
            configure(sigma, shape, result["profile"])
            m = measure(dialed, model, prompts, args, aligned)["mismatch_logp_abs_mean"]
            grid[shape].append([sigma, m])
            print(
                f"{shape:8} sigma {sigma:7.0e}: mean |log mu - log pi| {m:.3e} = {m / unit:7.2f}x",
                flush=True,
            )
    configure(0.0)
    return result

def plain_unit(ckpt, model, prompts, args, cfg):
    """The calibration's head: the plain bf16 run's mismatch (the unit) and its profile by
    bucket of pi, and fp16's, as this chip's engine and trainer make them."""
    llm = {}
    for name in ("fp16", "bf16"):  # the plain runs' mismatch, as the chip makes it
        llm[name] = start_engine(
            ckpt, get_precision(name).vllm_dtype, args.seed, cfg.max_seq_len
        )
        sync_weights(llm[name], hf_named_tensors(model), get_precision(name).engine_dtype)
    plain = {
        n: measure(llm[n], model, prompts, args, get_precision(n, device="cpu")) for n in llm
    }
    unit = plain["bf16"]["mismatch_logp_abs_mean"]
    sizes = [s if s is not None else 0.0 for s in plain["bf16"]["pi_bucket_logp_abs_mean"]]
    profile = [s / unit for s in sizes]  # bf16's mismatch by bucket of pi, over its mean
    print(
        f"unit (bf16) {unit:.3e}; fp16 {plain['fp16']['mismatch_logp_abs_mean'] / unit:.3f}x; "
        f"bf16's profile by bucket of pi {[round(x, 2) for x in profile]}"
    )
    return {
        "experiment": "dial-calibration",
        "checkpoint": ckpt,
        "machine": machine(),
        "seed": args.seed,
        "unit": unit,
        "unit_is": "plain bf16's mean |log mu - log pi|",
        "fp16": plain["fp16"]["mismatch_logp_abs_mean"],
        "profile": profile,
        "pi_edges": list(PI_EDGES),
        "plain": plain,
        "grid": {},
    }

def main(argv=None):
    p = common.parser("the mismatch dial: calibrate it on this chip")
    p.add_argument("command", choices=["calibrate", "doses"])
    p.add_argument("--seed", type=int, default=0, help="the warm start and the samples")
    p.add_argument("--n-items", type=int, default=12)
    p.add_argument("--group-size", type=int, default=8, help="samples of each held-out prompt")
    p.add_argument("--json", required=True, help="where the calibration goes")
    p.add_argument("--extend", action="store_true",
                   help="keep --json's calibration, measure the shapes it lacks")
    p.add_argument("--doses", type=int, nargs="+", default=[1, 3, 10], help="doses: their s")
    args = p.parse_args(argv)
    args.max_new_tokens = 2 * args.n_items + 8
    if args.command == "doses":
        try:
            return print_doses(common.load_json(args.json, "dial.py calibrate"), args.doses)
        except ValueError as e:  # a dose beyond the calibrated grid
            common.refuse(str(e))
    common.writable(args.json)
    old = common.load(args.json) if args.extend else None  # read once: checked, then kept
    if args.extend:
        refuse_extend(args, old)
    common.finish(args, calibrate(args, old))

def print_doses(calibration, doses):
    """Each calibrated shape's s at each dose: what a dial run of that dose sets."""
    print(f"{'shape':12}" + "".join(f"{f'{d}x':>10}" for d in doses))
    for shape in calibration["grid"]:
        row = [sigma_for(calibration, shape, d) for d in doses]
        print(f"{shape:12}" + "".join(f"{s:10.3g}" for s in row))

def refuse_extend(args, old):
    """--extend adds shapes to a calibration of this chip, seed and warm start only."""
    if old is None:
        common.refuse(f"--extend: no calibration at {args.json}; calibrate without --extend")
    chip = ("cpu", "cpu_id", "cpu_isa", "gpu")  # not the host's name
    if any(old["machine"][k] != machine()[k] for k in chip) or old["seed"] != args.seed:
        common.refuse(f"--extend: {args.json} is another chip's or seed's calibration")
    if all(s in old["grid"] for s in SHAPES):
        common.refuse(f"--extend: {args.json} has every shape ({', '.join(SHAPES)})")

if __name__ == "__main__":
    main()
