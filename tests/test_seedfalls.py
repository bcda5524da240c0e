"""experiments/seedfalls.py's statistics by hand, its crossing's groups from a base's falls, and
campaign.py's crossed start (another seed's warm start) and split start (another seed's initial
weights)."""
import math

import pytest
import torch

import campaign
import seedfalls
import sites
import task
import variants
import warm_start
from conftest import tiny_args
from model import load_hf


def test_the_spread_of_falls_against_chance_matches_its_enumeration():
    """Three seeds, two variants falling once each, on one seed: by hand, both land on one seed
    with probability 1/3 (spread 4), else 2, so the null's mean is 8/3 and p = 1/3."""
    falls = [[True, True], [False, False], [False, False]]
    s, mean, hits, p = seedfalls.cluster_p(falls, draws=60_000)
    assert s == 4 and abs(mean - 8 / 3) < 0.02 and abs(p - 1 / 3) < 0.01
    apart = [[True, False], [False, True], [False, False]]  # every draw reaches its spread, 2
    assert seedfalls.cluster_p(apart, draws=1_000)[2:] == (1_000, 1.0)


def test_fishers_two_sided_p_and_spearmans_ranks_by_hand():
    """4 of 4 against 0 of 4: two tables of C(8, 4) = 70 as extreme, p = 2/70; 3 of 4 against
    1 of 4: the hypergeometric's 1, 16, 36, 16, 1 (of 70) at most 16 sum to 34/70."""
    assert math.isclose(seedfalls.fisher_two_sided(4, 4, 0, 4), 2 / 70)
    assert math.isclose(seedfalls.fisher_two_sided(3, 4, 1, 4), 34 / 70)
    assert seedfalls.fisher_two_sided(2, 4, 2, 4) == 1.0
    assert seedfalls.ranks([3.0, 1.0, 1.0]).tolist() == [3.0, 1.5, 1.5]
    rho, p = seedfalls.spearman([1, 2, 3, 4, 5], [2, 4, 8, 16, 32], draws=2_000)
    assert rho == pytest.approx(1.0) and p < 0.03  # 2 of 120 orders as extreme: p ~ 1/60


def rows(step0, dip=None):
    """Three metrics rows: the step-0 mean |d|, the batch's reward below 0.5 at step `dip`."""
    return [{"step": t, "mismatch_logp_abs_mean": step0, "reward_mean": 0.3 if t == dip else 0.9}
            for t in range(3)]


def test_the_crossing_reads_fragile_seeds_from_its_base_and_groups_the_crossed_runs():
    """The base fell on seed 5 alone: a start of 5 with stream 1 is 'fragile start, held stream',
    a start of 1 with stream 5 the other group; a run of both fragile parts is in neither. Each
    crossed run's step-0 mismatch is read against its start's own and its stream's own, in ratio
    (4.5e-4 is nearer 5e-4 than 2e-4; 3e-4 is 1.5x 2e-4 but 1.67x below 5e-4)."""
    base = "bf16-trunc-site-rne6"
    found = {base: [(1, rows(2e-4), {"heldout": 0.95}), (5, rows(5e-4, 1), {"heldout": 0.2})],
             f"{base}-warm5": [(1, rows(4.5e-4, 2), {"heldout": 0.1})],
             f"{base}-warm1": [(5, rows(3e-4), {"heldout": 0.9})],
             f"{base}-warm14": [(5, rows(1e-4), {"heldout": 0.3})]}
    c = seedfalls.crossing(found)[base]
    assert [(r["step0_nearer"], r["dip_step"]) for r in c["runs"]] == [
        ("start", None), ("start", 2), (None, None)]  # no own run of seed 14: no reading
    assert c["step0_nearer_start"] == [2, 2] and c["own"]["5"]["dip_step"] == 1
    assert c["fragile"] == [5]
    assert c["groups"] == {"fragile start, held stream": [1, 1],
                           "held start, fragile stream": [0, 1]}
    assert c["p_fisher_two_sided"] == 1.0  # one run a group tells nothing
    assert [(r["warm"], r["seed"], r["fell"]) for r in c["runs"]] == [
        (1, 5, False), (5, 1, True), (14, 5, True)]
    assert seedfalls.base_of(f"{base}-warm14") == base


def weights(folder):
    """A checkpoint's state dict."""
    return load_hf(folder, "cpu").state_dict()


def same(a, b):
    """Two state dicts equal to the bit."""
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_crossed_run_starts_from_the_other_seeds_warm_start(tmp_path, monkeypatch):
    """campaign.warm_init: seed 1's warm start (trained once, cached), whose weights are not
    seed 0's; the crossed records name their base's record but the start. (Two SFT steps: the
    cache keys the steps, so these are their own warm starts.)"""
    monkeypatch.setattr(warm_start, "SFT_STEPS", 2)
    args = tiny_args(str(tmp_path), "--seed", "0")
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    own, other = warm_start.warm_start(cfg, args.n_items, 0, "cpu"), campaign.warm_init(args, 1)
    assert other == warm_start.warm_start(cfg, args.n_items, 1, "cpu") != own
    assert not same(weights(own), weights(other))
    crossed = [v for v in variants.VARIANTS.values() if v.warm_seed is not None]
    assert crossed and all(seedfalls.base_of(v.name) for v in crossed)


def test_a_split_start_moves_the_initial_weights_alone(tmp_path, monkeypatch):
    """campaign.initial_weights_of: before any supervised step, seed 1's start from seed 0's
    initial weights is seed 0's init to the bit, not seed 1's; after two steps, from its own
    seed's, it is seed 1's start to the bit (the patch moves the init and nothing else), and
    task.seed_of is restored. The split records name their base's record but the init."""
    monkeypatch.setattr(warm_start, "WARMSTART_DIR", str(tmp_path / "warm"))
    args = tiny_args(str(tmp_path), "--seed", "1")
    cfg, original = warm_start.model_config(args.n_items, args.max_new_tokens), task.seed_of
    for steps in (0, 2):
        monkeypatch.setattr(warm_start, "SFT_STEPS", steps)
        own = [weights(warm_start.warm_start(cfg, args.n_items, s, "cpu")) for s in (0, 1)]
        split = [weights(campaign.warm_init(args, 1, i)) for i in (0, 1)]
        if steps == 0:
            assert same(split[0], own[0]) and not same(split[0], own[1])
        else:
            assert same(split[1], own[1]) and not same(split[0], own[0])
    assert task.seed_of is original
    split = [v for v in variants.VARIANTS.values() if v.init_seed is not None]
    assert split and all(seedfalls.base_of(v.name) for v in split)


def test_the_sites_rounding_leaves_a_warm_starts_training_alone(tmp_path, monkeypatch):
    """A split start is trained inside its run, after sites.install: the warm start's matmuls run
    unstrict, where no mode rounds, so two supervised steps with rne6 installed give the plain
    recipe's weights to the bit."""
    monkeypatch.setattr(warm_start, "SFT_STEPS", 2)
    args = tiny_args(str(tmp_path))
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    starts = []
    for mode in (None, "rne6"):
        monkeypatch.setattr(warm_start, "WARMSTART_DIR", str(tmp_path / str(mode)))
        sites.use(mode)
        try:
            starts.append(weights(warm_start.warm_start(cfg, args.n_items, 0, "cpu")))
        finally:
            sites.use(None)
    assert same(*starts)


def test_the_split_starts_cluster_test_reads_the_starts_every_base_ran():
    """Two bases, one fall each, on the same start: the starts both ran (not init 14's, which
    one base lacks) form the table; spread 2^2 + 0 = 4, reached by chance when both falls land
    on one of the two starts: p near 1/2."""
    a = [{"init": 0, "seed": 3, "fell": True}, {"init": 3, "seed": 0, "fell": False},
         {"init": 14, "seed": 3, "fell": False}]
    b = [{"init": 3, "seed": 0, "fell": False}, {"init": 0, "seed": 3, "fell": True}]
    c = seedfalls.split_cluster({"a": {"runs": a}, "b": {"runs": b}})
    assert c["starts"] == [[0, 3], [3, 0]] and c["falls_by_start"] == [2, 0]
    assert c["falls_by_base"] == [1, 1] and c["spread"] == 4
    assert abs(c["p"] - 0.5) < 0.01
    assert seedfalls.split_cluster({"a": {"runs": a}}) is None  # one base: nothing to cluster
