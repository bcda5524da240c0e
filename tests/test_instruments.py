"""experiments/instruments.py: the clipped shares by the sign of A, and the buckets of pi, which
add up to the run's mean mismatch."""
import pytest
import torch

import grpo
from grpo import Batch, grpo_loss, loss_norm
from instruments import loss as loss_stats


def loss_of(logp, old, mu, adv, mask, algorithm="grpo"):
    norm = loss_norm(mask, algorithm, False, None)
    return grpo_loss(logp, old, Batch(None, mask, mu, adv, {}), norm, algorithm, grpo.CAPS.get(algorithm))


def test_clip_statistics_count_only_sequences_with_an_advantage():
    old = torch.log(torch.full((3, 3), 0.4))
    ratio = torch.tensor([[1.5, 1.0, 1.0], [1.0, 0.5, 1.0], [3.0, 3.0, 3.0]])
    mask, adv = torch.ones(3, 3), torch.tensor([1.0, -1.0, 0.0])  # the third has no gradient
    _, parts = loss_of(old + ratio.log(), old, old, adv, mask)
    stats = loss_stats(parts, adv, mask, "grpo")
    assert stats["clip_frac_pos"] == pytest.approx(1 / 3) and stats["clip_frac_neg"] == pytest.approx(1 / 3)
    assert stats["clip_seq_frac"] == 1.0 and stats["ratio_dev_max"] == pytest.approx(2.0)


def test_pi_buckets_add_up_to_the_mean_mismatch(dtype_runs):
    """The shift-share identity: mean |d| = sum over buckets of share x mean, in every row."""
    for rows in dtype_runs[1].values():
        for r in rows:
            shares, sizes = r["pi_bucket_frac"], r["pi_bucket_logp_abs_mean"]
            assert sum(shares) == pytest.approx(1.0)
            total = sum(f * s for f, s in zip(shares, sizes) if s is not None)
            assert total == pytest.approx(r["mismatch_logp_abs_mean"], rel=1e-9)
