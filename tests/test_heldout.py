"""experiments/heldout.py: a policy's held-out accuracy, by one fp32 engine, against a count by hand."""
import math

import numpy as np
import pytest
import torch

import heldout
import rollout
import task
from model import hf_named_tensors, load_hf


def test_heldout_is_the_fp32_engines_count_of_right_answers(engine, warm_dir, varied_reward):
    """heldout.py's accuracy and s.e. equal a count by hand: the warm start's weights in the fp32
    engine, the same seeded samples, the (varied) reward per sample, the s.e. over problems (ddof 1)."""
    a = heldout.main(["--samples", "2"], engine)
    max_new_tokens = 2 * 12 + 8  # the default --n-items 12's budget
    ckpt = a["checkpoint"]
    llm = engine("float32")
    rollout.sync_weights(llm, hf_named_tensors(load_hf(ckpt)), torch.float32)
    problems = task.make_splits(0, 12, task.N_EVAL)[0]
    torch.manual_seed(task.seed_of("heldout", 0))
    samples = rollout.generate(llm, [task.prompt_ids(p) for p, _ in problems], 2, max_new_tokens, task.EOS_ID)
    right = np.array([task.reward(s.response_ids, None) for s in samples]).reshape(len(problems), 2).mean(1)
    assert 0 < right.mean() < 1  # the parity reward varies: the s.e. is not trivially 0
    assert a["accuracy"] == right.mean() and a["problems"] == 32 and a["samples_per_problem"] == 2
    assert a["se"] == pytest.approx(right.std(ddof=1) / math.sqrt(len(problems)))
