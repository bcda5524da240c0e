"""The offline experiments on the real engines: the mismatch probe with the fixes' rows and table, the GradScaler
ablation, the held-out reader, the statistics by hand, the campaign runner and the figures."""
import json
import math
import os

import pytest

from experiments import plot, probe
from precision import machine_line


def probe_argv(experiment, *extra):
    return [experiment, "--group-size", "4", *extra]


def test_offline_probe_with_the_fixes_rows(engine, warm_dir, monkeypatch):
    """Every engine x trainer pair on the (tiny) warm start, on 32 held-out prompts: the matched 16-bit
    rows order as the formats' precision says; on identical tokens (paired), bf16 against bf16 is the
    unit and fp16's mismatch is a fraction of it; the fp32 engine agrees with itself (decode, prefill); the
    trainers on the engine's kernels leave under 1 % of the emulated trainers' mismatch (0 where the engine's
    GEMM is batch-invariant: fp16 here)."""
    out = os.path.join(warm_dir, "probe.json")
    probe.main(probe_argv("mismatch", "--json", out), engine)
    result = json.load(open(out))
    rows = {(r["engine"], r["trainer"]): r for r in result["rows"]}
    assert len(rows) == 9 + 4 + 2 and result["sequences_per_engine"] == 32 * 4 and result["machine"]["torch"]
    k3 = {pair: r["mismatch_k3"] for pair, r in rows.items()}
    assert k3[("fp32", "fp32")] * 100 <= k3[("fp16", "fp16")] < k3[("bf16", "bf16")], k3
    assert k3[("bf16", "fp32")] > k3[("fp16", "fp32")] > k3[("fp32", "fp32")], k3  # engine-side rounding alone
    paired_rows = {(r["engine"], r["trainer"]): r for r in result["paired_rows"]}
    paired = {pair: r["over_bf16"] for pair, r in paired_rows.items()}
    assert set(paired) == set(rows)
    assert paired[("bf16", "bf16")]["ratio"] == pytest.approx(1.0)
    assert paired[("fp16", "fp16")]["ci95"][1] < 1 and paired[("fp32", "fp32")]["ratio"] < 0.01
    lo, hi = paired[("bf16+head32", "bf16+head32")]["ci95"]
    assert lo <= paired[("bf16+head32", "bf16+head32")]["ratio"] <= hi
    self_rows = {r["engine"]: r for r in result["self_rows"]}
    assert set(self_rows) == set(probe.ENGINES) and self_rows["fp32"]["mismatch_logp_abs_mean"] < 1e-6
    for name in ("bf16", "fp16"):
        plain, aligned = (rows[(name, t)]["mismatch_logp_abs_mean"] for t in (name, f"{name}-aligned"))
        assert aligned <= 0.01 * plain and paired[(name, f"{name}-aligned")]["ratio"] <= 0.01
    assert rows[("fp16", "fp16-aligned")]["mismatch_logp_abs_mean"] == 0
    assert set(result["engine_tokens_per_s"]) == set(probe.ENGINES) and set(result["trainer_fwd_bwd_s"]) == {*probe.ENGINES, "bf16-aligned"}
    # the fixes table: each fix's paired row and cost beside its RL result from an experiment of the same machine
    d = {"n": 2, "mean": 0.1, "se": 0.05, "ci95": [-0.5, 0.7], "p_sign_flip": 0.5}
    exp = {"machine": machine_line(result["machine"]), "arms": {"arm": {"bf16": {}, "fp16": {"reward_last10_minus_bf16": d}}}}
    exp_path, fixes_path = os.path.join(warm_dir, "exp-fixes.json"), os.path.join(warm_dir, "fixes.json")
    json.dump(exp, open(exp_path, "w"))
    plot.main(["fixes", out, exp_path, "--out", fixes_path])
    table = {e["fix"]: e for e in json.load(open(fixes_path))["fixes"]}
    assert table["fp16"]["rl"] == {"arm": d} and table["bf16"]["rl"] == {"arm": None}
    assert table["bf16-aligned"]["mismatch_logp_abs_mean"] == paired_rows[("bf16", "bf16-aligned")]["mismatch_logp_abs_mean"]
    assert table["bf16"]["engine_speed_vs_bf16"] == 1 and table["bf16-aligned"]["trainer_time_vs_bf16"] > 0
    json.dump({**exp, "machine": "another chip"}, open(exp_path, "w"))
    with pytest.raises(SystemExit) as e:  # an offline row and an RL result of two chips are not one fix's
        plot.main(["fixes", out, exp_path, "--out", fixes_path])
    assert e.value.code == 2


def test_heldout_reads_any_policy_with_one_fp32_engine(engine, warm_dir):
    """The same policy read twice gives the same figure (the sampling is seeded); its s.e. is over
    problems, and with every sample wrong or right it is 0."""
    a = probe.main(["heldout", "--samples", "2"], engine)
    b = probe.main(["heldout", "--samples", "2"], engine)
    assert a["accuracy"] == b["accuracy"] and a["problems"] == 32 and a["samples_per_problem"] == 2
    assert 0 <= a["accuracy"] <= 1 and (a["se"] > 0) == (0 < a["accuracy"] < 1)


def test_fp16_backward_loses_gradient_to_underflow_without_loss_scaling(engine, varied_reward):
    """A real fp16 backward through the 16-bit trainer, one GRPO batch: unscaled, most entries of the
    logits' gradient underflow (0 or subnormal); at the GradScaler's initial scale far fewer do, and the
    weights' gradient is closer to float32's; 2**24 overflows."""
    from precision import INIT_SCALE
    result = probe.main(probe_argv("scaler", "--batch-size", "16"), engine)
    rows = {(r["dtype"], r["loss_scale"]): r for r in result["rows"]}
    plain, scaled = rows[("fp16", 1.0)], rows[("fp16", INIT_SCALE)]
    assert plain["logit_grad_underflow"] > 0.5 and scaled["logit_grad_underflow"] < plain["logit_grad_underflow"] / 10, rows
    assert scaled["logit_grad_zero"] <= plain["logit_grad_zero"] and scaled["weight_grad_zero"] <= plain["weight_grad_zero"]
    assert scaled["rel_error"] < plain["rel_error"], rows
    assert not rows[("fp16", 2.0 ** 24)]["finite"] and rows[("bf16", 1.0)]["finite"]


def test_t_quantile_against_the_table():
    """Student's t 0.975 quantile: the table to 10 degrees of freedom, Cornish-Fisher beyond (R's qt)."""
    assert probe.t_quantile(19) == pytest.approx(2.093, abs=1e-3) and probe.t_quantile(11) == pytest.approx(2.201, abs=3e-3)
    assert probe.t_quantile(2) == 4.303


def test_campaign_runs_once_skips_what_is_done_and_resumes(warm_dir, tmp_path):
    """The runner in fresh processes on a one-run plan: the run's small files land in
    results/<machine>/NAME; run again, nothing runs; with its results gone but its checkpoint there,
    it is resumed (no step redone) and its files come back identical."""
    import subprocess
    import sys
    from conftest import ROOT, tiny_args
    import train_grpo
    from experiments import campaign
    from precision import machine
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = train_grpo.warm_start(train_grpo.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
    cmd = [sys.executable, "experiments/campaign.py", "--plan", "smoke", "--seeds", "0", "--samples", "1",
           "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results"),
           "--", "--steps", "2", "--batch-size", "4", "--group-size", "4", "--init", init]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    kept = tmp_path / "results" / campaign.machine_group(machine()) / "grpo-fp32-s0"
    assert "1 runs, 0 done" in first and sorted(os.listdir(kept)) == ["args.json", "heldout.json", "metrics.jsonl"]
    metrics = (kept / "metrics.jsonl").read_text()
    assert [json.loads(r)["step"] for r in metrics.splitlines()] == [0, 1]
    # The record tells two CPU generations apart where a VM masks the model name (x86 Linux).
    recorded = json.loads((kept / "args.json").read_text())["machine"]
    if os.path.isfile("/proc/cpuinfo") and "cpu family" in open("/proc/cpuinfo").read():
        assert [part.isdigit() for part in recorded["cpu_id"].split("/")] == [True] * 3, recorded
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "1 runs, 1 done" in again and "[1/1]" not in again
    for f in os.listdir(kept):
        os.remove(kept / f)
    os.rmdir(kept)
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "resuming" in resumed and (kept / "metrics.jsonl").read_text() == metrics
    subprocess.run(cmd[:2] + ["--stop-after", "1"] + cmd[2:], cwd=ROOT, capture_output=True, text=True, check=True)
    stopped = kept.parent / "step1" / "grpo-fp32-s0"  # the same run ended after its first update, read
    assert json.loads((stopped / "args.json").read_text())["stop_after"] == 1 and (stopped / "heldout.json").is_file()
    same = lambda row: {k: v for k, v in json.loads(row).items() if not k.startswith("time_") and "per_s" not in k}  # noqa: E731
    assert [same(r) for r in (stopped / "metrics.jsonl").read_text().splitlines()] == [same(metrics.splitlines()[0])]


def test_quick_probe_reads_a_policy_in_bf16_and_fp16_with_layer_errors(engine, warm_dir):
    """probe.py mismatch --quick (the campaign's cross-probe of a trained policy): the three dtypes' engines, each with
    its matched and aligned trainer, no costs; per layer, every 16-bit mode's error against float32
    is positive, and bf16's logits are further off than fp16's."""
    result = probe.main(probe_argv("mismatch", "--quick", "--group-size", "2"), engine)
    pairs = {(r["engine"], r["trainer"]) for r in result["paired_rows"]}
    assert pairs == {("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "bf16-aligned"), ("fp16", "fp16"), ("fp16", "fp16-aligned")}
    assert not result["trainer_fwd_bwd_s"] and result["seed"] == 0
    layers = result["layers"]
    assert set(layers) == {"bf16", "fp16", "bf16-aligned", "fp16-aligned"}
    assert all(len(e) == 4 + 2 and all(0 < x < 1 for x in e) for e in layers.values())
    assert layers["bf16"][-1] > layers["fp16"][-1] and layers["bf16-aligned"][-1] > layers["fp16-aligned"][-1]


def test_growth_decomposition_by_hand():
    """m_t - m_0 = sum (f_t - f_0) s_0 + sum f_t (s_t - s_0), on two buckets, one empty at step 0."""
    rows = [{"pi_bucket_frac": [0.0, 1.0], "pi_bucket_logp_abs_mean": [None, 1e-4]},
            {"pi_bucket_frac": [0.25, 0.75], "pi_bucket_logp_abs_mean": [1e-3, 2e-4]}]
    m = [sum(f * (s or 0) for f, s in zip(r["pi_bucket_frac"], r["pi_bucket_logp_abs_mean"])) for r in rows]
    for r, mt in zip(rows, m):  # what each metrics row holds beside its buckets
        r.update(mismatch_logp_abs_mean=mt, response_len_mean=24, entropy_mean=0.5, logit_rms=3.0)
    plot.decompose(rows)
    assert rows[1]["mismatch_shift"] == pytest.approx(-0.25 * 1e-4)
    assert rows[1]["mismatch_within"] == pytest.approx(0.25 * 1e-3 + 0.75 * 1e-4)
    assert rows[1]["mismatch_shift"] + rows[1]["mismatch_within"] == pytest.approx(m[1] - m[0])
    assert rows[0]["mismatch_shift"] == rows[0]["mismatch_within"] == 0
    g = plot.growth(rows, None)  # growth's parts are over step 0's mismatch: growth - 1 = within + shift
    assert g["mismatch_growth"] == pytest.approx((m[0] + m[1]) / 2 / m[0])  # the last 10 of two rows: both
    assert g["within"] + g["shift"] == pytest.approx(g["mismatch_growth"] - 1)
    assert g["shift"] == pytest.approx(-0.25 * 1e-4 / 2 / 1e-4)


def test_growth_low_pi_tokens_by_hand():
    """The sampled tokens with pi < 0.9 (the first two buckets): their share of the tokens, last 10 over step 0, and
    their part of the mean mismatch; none for a run with no mismatch (the aligned trainer)."""
    row = lambda frac, size: {"pi_bucket_frac": frac, "pi_bucket_logp_abs_mean": size, "response_len_mean": 24,  # noqa: E731
                              "entropy_mean": 0.5, "logit_rms": 3.0,
                              "mismatch_logp_abs_mean": sum(f * (s or 0) for f, s in zip(frac, size))}
    rows = [row([0.01, 0.0, 0.09, 0.4, 0.5], [1e-2, None, 1e-3, 1e-4, 1e-6]),
            row([0.02, 0.02, 0.06, 0.4, 0.5], [2e-2, 1e-2, 1e-3, 1e-4, 1e-6])]
    plot.decompose(rows)
    g = plot.growth(rows, None)
    assert g["low_pi_frac_growth"] == pytest.approx((0.01 + 0.04) / 2 / 0.01)
    m1 = 0.02 * 2e-2 + 0.02 * 1e-2 + 0.06 * 1e-3 + 0.4 * 1e-4 + 0.5 * 1e-6
    assert g["low_pi_share"] == pytest.approx((1e-4 / rows[0]["mismatch_logp_abs_mean"] + 6e-4 / m1) / 2)
    zero = [row([0.01, 0.0, 0.09, 0.4, 0.5], [0.0, None, 0.0, 0.0, 0.0])] * 2
    plot.decompose(zero)
    assert plot.growth(zero, None)["low_pi_share"] is None


def test_cross_probe_by_hand(capsys):
    """A probed policy's figures (probed) and the cross-probe's paired log ratios (print_cross), on two seeds by hand:
    bf16-trained / fp16-trained is 2 and 4 in bf16, 1 and 2 in fp16; the unsure share is the fp32 row's pi < 0.9."""
    def probe(bf16, fp16, low):
        row = lambda mode, m: {"engine": mode, "trainer": mode, "mismatch_logp_abs_mean": m,  # noqa: E731
                               "pi_bucket_frac": [low / 2, low / 2, 0.1, 0.4, 0.5 - low]}
        return {"paired_rows": [row("fp32", 1e-8), row("bf16", bf16), row("fp16", fp16)], "layers": None}
    p = plot.probed(probe(4e-4, 2e-5, 0.01))
    assert (p["probe_bf16"], p["probe_fp16"]) == (4e-4, 2e-5) and p["probe_low_pi_frac"] == pytest.approx(0.01)
    cell = lambda pols: {"seeds": [0, 1], "n": 2, **{k: [x[k] for x in pols] for k in pols[0]}}  # noqa: E731
    out = {"arms": {"arm": {"warm start": cell([plot.probed(probe(1e-4, 1e-5, 0.01))] * 2),
                            "bf16": cell([plot.probed(probe(2e-4, 2e-5, 0.02)), plot.probed(probe(4e-4, 4e-5, 0.02))]),
                            "fp16": cell([plot.probed(probe(1e-4, 2e-5, 0.01)), plot.probed(probe(1e-4, 2e-5, 0.01))])}}}
    plot.print_cross(out)
    d = out["arms"]["arm"]["bf16"]
    assert d["cross_bf16"]["mean"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert d["cross_fp16"]["mean"] == pytest.approx((0 + math.log(2)) / 2)
    assert d["cross_excess"]["mean"] == pytest.approx(math.log(2)) and d["cross_excess"]["se"] == pytest.approx(0)
    assert "in bf16 minus the same in fp16: +0.693" in capsys.readouterr().out
