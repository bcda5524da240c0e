"""
experiments/common.py: what every experiment shares, with no torch: the paths (importing it
puts the core on sys.path), one-line refusals, atomic JSON, and the statistics every table
uses (mean and s.e. with ddof 1, paired differences with a t interval and the exact
sign-flip p, Holm's adjustment).

It teaches: a difference between two variants is paired by seed, and its p-value is exact:
all 2^n sign patterns, no normal approximation. Left out: bootstraps of runs (n <= 15).
"""

import argparse
import itertools
import json
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT]  # the core (task.py, model.py, ...), from anywhere
# Buckets of pi, the trainer's probability of the sampled token: a sharp policy's tokens sit
# mostly above 0.9, so the edges split the top finely.
PI_EDGES = (0.0, 0.5, 0.9, 0.99, 0.999, 1.0)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)  # dof 1-10

def refuse(message):  # bad input: one line and exit 2, as train_grpo.py
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

def parser(description):
    """An argparse parser whose errors are one line and exit 2."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.error = refuse
    return p

def at_least(low):
    """An argparse type: an int >= low."""

    def parse(text):
        if int(text) < low:  # a ValueError becomes argparse's "invalid value"
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return int(text)

    return parse

def writable(path):  # refuses a JSON path whose folder is missing or read-only
    if path and not os.access(os.path.dirname(os.path.abspath(path)) or ".", os.W_OK):
        refuse(f"--json {path}: its folder does not exist or cannot be written")

def write_json(path, data):
    """The JSON, then a rename: a kill leaves the old file or the new (model.write_atomic's
    rule, here without torch, so that drawing a figure never loads it)."""
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(data, indent=1))
    os.replace(path + ".tmp", path)

def finish(args, result):
    """The result to --json (atomically), where one is asked for."""
    if args.json:
        write_json(args.json, result)
        print(f"\nwritten to {args.json}")
    return result

def load(path):  # a JSON file, or None where there is none
    return json.load(open(path)) if os.path.isfile(path) else None

def load_json(path, what):  # a JSON file another command wrote, or a one-line refusal
    try:
        return json.load(open(path))
    except (OSError, ValueError) as e:
        refuse(f"{path} is not the JSON of `{what}` ({type(e).__name__})")

def machine_line(m):  # one line of instruments.machine()'s record, under every table
    return (
        f"{m['gpu'] or m['cpu']} ({' '.join(m['cpu_isa'])}), torch {m['torch']}, "
        f"{m['vllm']}, host {m['host']}"
    )

def fmt(x, spec=".1e"):
    return "-" if x is None else format(x, spec)

def t_quantile(dof, z=1.959964):
    """Student's t 0.975 quantile: the table to 10 dof, then Cornish-Fisher (within 0.003)."""
    if dof <= 10:
        return T975[dof - 1]
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)

def mean_se(x):  # the mean and its standard error (ddof 1; None for one value)
    x = np.asarray(x, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None

def paired(a, b):
    """a - b by seed: mean, s.e., 95 % t interval, exact two-sided sign-flip p (all 2^n)."""
    d = np.asarray(a) - np.asarray(b)
    m, se = mean_se(d)
    signs = itertools.product((1, -1), repeat=len(d))
    flips = [abs((d * s).mean()) >= abs(m) - 1e-12 for s in signs]
    half = t_quantile(len(d) - 1) * se if se is not None else None
    return {
        "n": len(d),
        "mean": m,
        "se": se,
        "ci95": [m - half, m + half] if half is not None else None,
        "p_sign_flip": sum(flips) / len(flips),
    }

def holm(ps):
    """Holm's step-down adjustment of m p-values (the family-wise error at the nominal
    level): the i-th smallest times (m - i + 1), made non-decreasing, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    adjusted, running = [None] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        adjusted[i] = running
    return adjusted

def hypergeometric(falls, n, group):
    """Fisher's tables: `falls` of `n` runs fell, `group` of the runs form the first group.
    {x: the ways x of the falls land in the group}, exact integers; they sum to comb(n, group)."""
    lo, hi = max(0, falls - (n - group)), min(falls, group)
    return {x: math.comb(falls, x) * math.comb(n - falls, group - x) for x in range(lo, hi + 1)}
