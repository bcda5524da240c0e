"""experiments/sites_audit.py: the bias's parts along and across E g, the rank test and the
within-seed test, by hand."""
import numpy as np
import pytest

import sites_audit


def test_parts_by_hand():
    """along = b.Eg / |Eg| = -0.3 / 0.6 = -0.5, across = sqrt(|b|^2 - along^2): 0 at |b|^2 = 0.25,
    0.5 at 0.5; both over sigma = 2. A negative estimate of across's square reads 0."""
    row = {"b2": 0.5, "b_dot_eg": -0.3, "eg2": 0.36, "sigma2": 4.0, "bias_over_noise": 0.35,
           "clipped_share": 0.1, "mismatch_logp_abs_mean": 2e-4, "resolved": True}
    p = sites_audit.parts(row)
    assert p["along"] == pytest.approx(-0.25) and p["across"] == pytest.approx(0.25)
    assert sites_audit.parts({**row, "b2": 0.2})["across"] == 0


def test_rank_p_by_hand():
    """Two fallen of five: on top, 1 / C(5, 2) = 0.1; at ranks 4 and 2 (sum 6) two of the ten pairs
    sum to 6 or more ({2, 4}, {3, 4}): 0.2; at the bottom, every pair: 1."""
    fell = [True, True, False, False, False]
    assert sites_audit.rank_p([5, 4, 3, 2, 1], fell) == pytest.approx(0.1)
    assert sites_audit.rank_p([5, 1, 3, 4, 2], [True, False, True, False, False]) == pytest.approx(0.2)
    assert sites_audit.rank_p([1, 2, 3, 4, 5], fell) == 1


def test_within_seed_by_hand(monkeypatch):
    """Seed 0: the fallen run (3) above both held (1, 2); seed 1: below its one held (0 < 1): 2 of 3
    pairs. Of the 3 x 2 labellings within seeds, 3 reach 2/3 or more: p 0.5, here by 4,000 draws."""
    runs = [(0, True, 3.0), (0, False, 1.0), (0, False, 2.0), (1, True, 0.0), (1, False, 1.0)]
    monkeypatch.setattr(sites_audit, "DRAWS", 4000)
    share, p = sites_audit.within_seed(runs, np.random.default_rng(0))
    assert share == pytest.approx(2 / 3) and p == pytest.approx(0.5, abs=0.03)
    assert sites_audit.within_seed([(0, False, 1.0)], np.random.default_rng(0)) == (None, None)
