"""experiments/startfalls.py's statistics by hand and against enumeration, and which runs it
reads as distinct starts."""
import itertools
import math

import numpy as np
import pytest

import seedfalls
import startfalls


def test_auc_and_the_exact_rank_sum_p_by_hand():
    """Ranks 1-4, two fell. On 3 and 4: every fell run above every held one (AUC 1); of the
    C(4, 2) = 6 rank sums 3, 4, 5, 5, 6, 7 (mean 5), two lie 2 from it: p = 2/6. On 2 and 4:
    3 of the 4 pairs (AUC 0.75); sum 6, and four of the six lie at least 1 from 5: p = 4/6."""
    values = [1.0, 2.0, 3.0, 4.0]
    assert startfalls.auc(values, [False, False, True, True]) == 1.0
    assert math.isclose(startfalls.rank_sum_p(values, [False, False, True, True]), 2 / 6)
    assert startfalls.auc(values, [False, True, False, True]) == 0.75
    assert math.isclose(startfalls.rank_sum_p(values, [False, True, False, True]), 4 / 6)
    assert startfalls.auc([1.0, 1.0], [True, False]) == 0.5  # a tie counts half


def test_the_exact_p_equals_the_enumeration_of_every_choice_with_ties():
    """Ten runs with ties, four fell: the counted p equals the share of all 210 choices of four
    whose mean-rank sum lies as far from its mean, enumerated."""
    rng = np.random.default_rng(3)
    for _ in range(5):
        values = rng.integers(0, 5, size=10).astype(float)
        fell = np.zeros(10, dtype=bool)
        fell[rng.choice(10, size=4, replace=False)] = True
        r = seedfalls.ranks(values)
        mean, seen = 4 * r.sum() / 10, abs(r[fell].sum() - 4 * r.sum() / 10)
        sums = [r[list(c)].sum() for c in itertools.combinations(range(10), 4)]
        brute = sum(abs(s - mean) >= seen - 1e-9 for s in sums) / len(sums)
        assert startfalls.rank_sum_p(values, fell) == pytest.approx(brute, abs=1e-12)


def row(share, heldout_before=0.9):
    """A step-0 row: pi_bucket_frac with `share` below pi 0.9, the other readings fixed."""
    return {"pi_bucket_frac": [share / 2, share / 2, 1 - share, 0.0, 0.0], "entropy_mean": 0.02,
            "reward_mean": 0.9, "logit_rms": 6.0, "mismatch_logp_abs_mean": 3e-4,
            "eval_accuracy_before": heldout_before}


def test_the_distinct_starts_are_the_bases_own_at_the_seeds_and_its_split_runs():
    """The base's own runs at --seeds, its split runs (init 14 on seed 3); a crossed run
    (warm14: seed 14's start reused) and a seed outside --seeds are left out; least_sure is the
    share below pi 0.9."""
    base = "bf16-trunc-site-rne6"
    found = {base: [(0, [row(0.01)], {"heldout": 0.2}), (3, [row(0.02)], {"heldout": 0.95}),
                    (9, [row(0.03)], {"heldout": 0.95})],
             f"{base}-init14": [(3, [row(0.04)], {"heldout": 0.1})],
             f"{base}-warm14": [(3, [row(0.05)], {"heldout": 0.1})]}
    got = startfalls.starts(found, base, [0, 3])
    assert [(r["init"], r["seed"], r["own"], r["fell"]) for r in got] == [
        (0, 0, True, True), (3, 3, True, False), (14, 3, False, True)]
    assert [r["least_sure"] for r in got] == pytest.approx([0.01, 0.02, 0.04])


def test_a_later_step_reads_that_row_and_the_mismatchs_growth_since_step_0():
    """At step 1 the readings are row 1's, the sixth the growth of mean |d| since step 0 (3x);
    a run whose batch reward dipped below 0.5 at step 1 counts as dipped by then."""
    base = "bf16-trunc-site-rne6"
    first, later = row(0.01), {**row(0.03), "mismatch_logp_abs_mean": 9e-4}
    rows = [{**first, "step": 0}, {**later, "step": 1, "reward_mean": 0.2}]
    got = startfalls.starts({base: [(0, rows, {"heldout": 0.1})]}, base, [0], step=1)
    assert got[0]["least_sure"] == pytest.approx(0.03)
    assert got[0]["mismatch_growth"] == pytest.approx(3.0) and got[0]["dip_step"] == 1
    assert "eval_accuracy_before" not in got[0]
