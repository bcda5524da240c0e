"""experiments/sites_audit.py: the bias's parts along and across E g, the rank test and the
within-seed test, by hand; a variant's falls counted over the seeds read."""
import json
import os

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


MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
ROW = {"b2": 0.5, "b_dot_eg": -0.3, "eg2": 0.36, "sigma2": 4.0, "clipped_share": 0.1,
       "mismatch_logp_abs_mean": 2e-4, "resolved": True}  # an audit's row; bias_over_noise its own


def test_the_dip_contrasts_by_hand(tmp_path, capsys):
    """--dip: |b| / sigma of trunc less rne by seed -0.2, -0.2, -0.3 (mean -0.7 / 3; only the two
    one-signed patterns of eight reach |sum| 0.7: p 0.25), rne6 less rne +0.05, +0.05, -0.1 (mean 0,
    p 1); Holm over the two: 0.5 and 1. A seed one variant lacks is left out."""
    folder = tmp_path / "sites" / sites_audit.DIP
    folder.mkdir(parents=True)
    bias = {"bf16-trunc": [0.3, 0.4, 0.5], "bf16-trunc-site-trunc": [0.1, 0.2, 0.2],
            "bf16-trunc-site-rne6": [0.35, 0.45, 0.4]}
    for v, values in bias.items():
        for s, x in enumerate(values + ([0.9] if v == "bf16-trunc" else [])):
            row = {**ROW, "bias_over_noise": x}
            audit = {"loss": "gspo-engine", "variant": v, "machine": MACHINE, "rows": [row]}
            (folder / f"{v}-s{s}.json").write_text(json.dumps(audit))
    out = sites_audit.dip(str(tmp_path))
    assert out["seeds"] == [0, 1, 2]
    fix, rne6 = out["contrasts"]["bias_over_noise"]
    assert (fix["a"], rne6["a"]) == ("bf16-trunc-site-trunc", "bf16-trunc-site-rne6")
    assert fix["mean"] == pytest.approx(-0.7 / 3) and fix["p_sign_flip"] == pytest.approx(0.25)
    assert rne6["mean"] == pytest.approx(0.0, abs=1e-12) and rne6["p_sign_flip"] == pytest.approx(1.0)
    assert (fix["p_holm"], rne6["p_holm"]) == pytest.approx((0.5, 1.0))
    assert out["contrasts"]["along"][0]["mean"] == pytest.approx(0.0)  # the same parts at every audit
    sites_audit.main([str(tmp_path), "--dip", "--out", str(tmp_path / "dip.png")])
    assert os.path.getsize(tmp_path / "dip.png") > 0 and "| bias_over_noise | bf16-trunc-site-trunc" in \
        capsys.readouterr().out
    assert json.load(open(tmp_path / "dip.json"))["seeds"] == [0, 1, 2]


def run_folder(root, v, seed, acc, mode):
    """One hand-set gspo-engine run of plan sites (AMX hidden): five rows, its held-out `acc`."""
    run = root / f"gspo-engine-{v}-s{seed}"
    run.mkdir()
    rounding = {"site_rounding": mode} if mode != "rne" else {}  # rne: the flag left out
    args = {"dtype": "bf16", "kernel_library": "_C", "amx_hidden": True, "seed": seed, "steps": 5,
            "machine": {**MACHINE, "cpu_isa": ["amx_tile"]}, **rounding}
    rest = {"pi_bucket_frac": [0.1] * 5, "pi_bucket_logp_abs_mean": [1e-4] * 5,
            "response_len_mean": 24.0, "entropy_mean": 0.1, "logit_rms": 3.0}
    rows = [{"step": s, "reward_mean": 0.9, "mismatch_logp_abs_mean": 2e-4, "mismatch_k1": -2e-5,
             **rest} for s in range(5)]
    (run / "args.json").write_text(json.dumps(args))
    (run / "heldout.json").write_text(json.dumps({"accuracy": acc}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_variants_falls_are_counted_over_the_seeds_read(tmp_path, monkeypatch):
    """The trainer truncating fell at seeds 2 and 3 of 0-3: read at --seeds 0 1, none of its two
    runs fell and only those seeds' audits are read; read at every seed, 2 of 4."""
    monkeypatch.setattr(sites_audit, "DRAWS", 100)
    heldout = {("bf16-noamx", "rne"): [0.95, 0.96, 0.94, 0.95],
               ("bf16-noamx-site-trunc", "trunc"): [0.9, 0.92, 0.2, 0.1]}
    (tmp_path / "sites" / "audit").mkdir(parents=True)
    for (v, mode), accs in heldout.items():
        for seed, acc in enumerate(accs):
            run_folder(tmp_path, v, seed, acc, mode)
            row = {**ROW, "bias_over_noise": 0.1 * (seed + 1)}
            audit = {"loss": "gspo-engine", "variant": v, "machine": MACHINE, "rows": [row]}
            (tmp_path / "sites" / "audit" / f"{v}-s{seed}.json").write_text(json.dumps(audit))
    first = sites_audit.analyse(str(tmp_path), [0, 1])
    trunc = first["variants"]["bf16-noamx-site-trunc"]
    assert first["seeds"] == [0, 1] and (trunc["fell"], trunc["runs"]) == (0, 2)
    assert trunc["bias_over_noise"] == pytest.approx(0.15)  # seeds 0 and 1's audits alone
    every = sites_audit.analyse(str(tmp_path))["variants"]["bf16-noamx-site-trunc"]
    assert (every["fell"], every["runs"]) == (2, 4)
    assert every["bias_over_noise"] == pytest.approx(0.25)
