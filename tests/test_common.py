"""experiments/common.py: the statistics every table uses, against values by hand."""
import itertools
import math

import numpy as np
import pytest

import common


@pytest.mark.parametrize("dof", [1, 2, 4, 7, 10, 11, 19, 40, 200])
def test_t_quantile_has_97_5_percent_below_it(dof):
    """Student's t density integrated numerically up to the quantile: 0.975, table or Cornish-Fisher."""
    q = common.t_quantile(dof)
    t = np.linspace(0, q, 200001)
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    density = np.exp(log_c - (dof + 1) / 2 * np.log1p(t ** 2 / dof))
    assert 0.5 + np.trapezoid(density, t) == pytest.approx(0.975, abs=2e-4)


def test_paired_differences_by_hand():
    diffs = [0.01, 0.02, -0.01, 0.02]
    d = common.paired([0.96, 0.97, 0.95, 0.98], [0.95, 0.95, 0.96, 0.96])
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.01)
    assert d["se"] == pytest.approx(math.sqrt(((0.0 ** 2 + 0.01 ** 2 + 0.02 ** 2 + 0.01 ** 2) / 3) / 4))
    # the sign-flip test by enumeration: of the 16 sign patterns of (.01, .02, -.01, .02), the means at least
    # as far from 0 as the observed .01: .01 (as observed), .015 (-.01 flipped), .01 (the first .01 and the -.01
    # flipped), and the 3 mirrors: 6 of 16
    means = [abs(sum(s * x for s, x in zip(signs, diffs)) / 4) for signs in itertools.product((1, -1), repeat=4)]
    assert d["p_sign_flip"] == sum(m >= 0.01 - 1e-12 for m in means) / 16 == 6 / 16
    assert d["ci95"][0] < 0.01 < d["ci95"][1]


def test_holm_multiplies_the_ith_smallest_and_keeps_the_order():
    """Four p-values: the smallest times 4, the next times 3 (but never below the one before), the
    rest capped at 1; each back in its own place."""
    assert common.holm([0.04, 0.01, 0.03, 0.5]) == pytest.approx([0.09, 0.04, 0.09, 0.5])
    assert common.holm([0.2, 0.3]) == pytest.approx([0.4, 0.4])


def test_hypergeometric_tables_by_hand():
    """2 falls among 5 runs: a group of 3 holds 0, 1 or 2 of them in C(2,x) C(3,3-x) ways, 1 + 6 + 3
    of C(5,3) = 10; a group of 4 holds at least 1, in 2 + 3 of C(5,4) = 5 ways."""
    assert common.hypergeometric(2, 5, 3) == {0: 1, 1: 6, 2: 3}  # 10 = C(5,3) in all
    assert common.hypergeometric(2, 5, 4) == {1: 2, 2: 3}  # 5 = C(5,4) in all
