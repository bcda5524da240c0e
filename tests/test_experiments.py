"""The offline experiments on the real engines: the mismatch probe with the fixes' rows and table, the GradScaler
ablation, the gradient-bias audit, the held-out reader, the statistics by hand, the campaign runner and the figures."""
import json
import math
import os

import numpy as np
import pytest
import torch

import rollout
import task
from experiments import plot, probe
from instruments import machine_line
from model import hf_named_tensors, load_hf

# Two sequences of three response tokens; the second one's last token is padding.
MASK = torch.tensor([[1., 1., 1.], [1., 1., 0.]])
ADV = torch.tensor([1.0, -1.0])


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
    # the fp32 LM head leaves the body's 16-bit rounding: far more mismatch than fp32 on both sides
    assert paired[("bf16+head32", "bf16+head32")]["ci95"][0] > 10 * paired[("fp32", "fp32")]["ratio"]
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


def test_heldout_is_the_fp32_engines_count_of_right_answers(engine, warm_dir, varied_reward):
    """probe.py heldout's accuracy and s.e. equal a count by hand: the warm start's weights in the fp32
    engine, the same seeded samples, the (varied) reward per sample, the s.e. over problems (ddof 1)."""
    a = probe.main(["heldout", "--samples", "2"], engine)
    args = probe.get_args(["heldout"])
    ckpt = a["checkpoint"]
    llm = engine("float32")
    rollout.sync_weights(llm, hf_named_tensors(load_hf(ckpt)), torch.float32)
    problems = task.make_splits(0, args.n_items, task.N_EVAL)[0]
    torch.manual_seed(task.seed_of("heldout", 0))
    samples = rollout.generate(llm, [task.prompt_ids(p) for p, _ in problems], 2, args.max_new_tokens, task.EOS_ID)
    right = np.array([task.reward(s.response_ids, None) for s in samples]).reshape(len(problems), 2).mean(1)
    assert 0 < right.mean() < 1  # the parity reward varies: the s.e. is not trivially 0
    assert a["accuracy"] == right.mean() and a["problems"] == 32 and a["samples_per_problem"] == 2
    assert a["se"] == pytest.approx(right.std(ddof=1) / math.sqrt(len(problems)))


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


@pytest.mark.parametrize("dof", [1, 2, 4, 7, 10, 11, 19, 40, 200])
def test_t_quantile_has_97_5_percent_below_it(dof):
    """Student's t density integrated numerically up to the quantile: 0.975, table or Cornish-Fisher."""
    q = probe.t_quantile(dof)
    t = np.linspace(0, q, 200001)
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)
    density = np.exp(log_c - (dof + 1) / 2 * np.log1p(t ** 2 / dof))
    assert 0.5 + np.trapezoid(density, t) == pytest.approx(0.975, abs=2e-4)


def test_audit_bias_gradient_equals_the_direct_formula():
    """d = grad J - grad J_IS = grad of sum_i (1 - w_i) A_i sum_t log pi / N, w_i = prod_t pi / mu."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    mu = logp.detach() - torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 3.0]]).log()  # pi / mu per token
    J, J_bias, w = probe.audit_losses(logp, logp.detach(), mu, ADV, MASK, MASK.sum())
    assert torch.allclose(w, torch.tensor([1.5, 0.5]))  # the padding token's 3.0 is not counted
    g = torch.autograd.grad(J, logp, retain_graph=True)[0]
    d = torch.autograd.grad(J_bias, logp)[0]
    assert torch.allclose(d, torch.tensor([[-0.5, -0.5, -0.5], [-0.5, -0.5, 0.]]) / 5)
    g_is = torch.autograd.grad(((w * ADV) * (logp * MASK).sum(1)).sum() / 5, logp)[0]
    assert torch.allclose(g - g_is, d)


def test_bias_statistics_by_hand():
    """Pairwise (U-statistic) estimates from Gram matrices: unbiased where |mean d|^2 is not, and the
    cross term E d . E g uses d and g of different batches only."""
    d = torch.tensor([[1., 0.], [3., 0.], [0., 2.], [0., -2.]], dtype=torch.float64)  # K = 4 batches, 2 weights
    g = torch.tensor([[1., 1.], [1., -1.], [2., 0.], [0., 2.]], dtype=torch.float64)
    s = probe.bias_statistics(d @ d.T, g @ g.T, d @ g.T)
    pairs = [(j, k) for j in range(4) for k in range(4) if j != k]
    assert s["b2"] == pytest.approx(sum((d[j] @ d[k]).item() for j, k in pairs) / 12)
    assert s["b_dot_eg"] == pytest.approx(sum((d[j] @ g[k]).item() for j, k in pairs) / 12)
    assert s["sigma2"] == pytest.approx(((g - g.mean(0)) ** 2).sum().item() / 3)
    # noise along b: each batch's g against the other three batches' summed d, e.g. batch 2: d_0 + d_1 + d_3
    # = (4, -2), g_2 . (4, -2) / sqrt 20 = 8 / sqrt 20; then the variance (ddof 1) over the four batches
    along = [1.0, 1.0, 8 / math.sqrt(20), 4 / math.sqrt(20)]
    assert s["noise_along_b"] == pytest.approx(torch.tensor(along).var().item())
    relabelled = torch.tensor([2, 0, 3, 1])  # the same batches in another order: the same figure
    s2 = probe.bias_statistics(*((x[relabelled] @ y[relabelled].T) for x, y in ((d, d), (g, g), (d, g))))
    assert s2["noise_along_b"] == pytest.approx(s["noise_along_b"])


def test_jackknife_interval_by_hand():
    """The interval of sigma2 (tr Cov g), recomputed from the vectors themselves: sigma2 with each batch
    left out, the jackknife s.e. sqrt((K-1)/K sum (x_i - mean)^2), and t(K-1) either side."""
    gen = torch.Generator().manual_seed(0)
    d, g = (torch.randn(6, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    out = probe.jackknife(d @ d.T, g @ g.T, d @ g.T)
    tr_cov = lambda x: ((x - x.mean(0)) ** 2).sum().item() / (len(x) - 1)  # noqa: E731
    leave = np.array([tr_cov(g[torch.arange(6) != i]) for i in range(6)])
    se = math.sqrt(5 / 6 * ((leave - leave.mean()) ** 2).sum())
    assert out["sigma2"] == pytest.approx(tr_cov(g))
    assert out["sigma2_ci"] == pytest.approx((tr_cov(g) - probe.t_quantile(5) * se, tr_cov(g) + probe.t_quantile(5) * se))


def test_audit_measures_bias_where_the_mismatch_is(engine, varied_reward):
    """The real audit on the tiny warm start: the sequence weights pi / mu stray from 1 by bf16's
    rounding, far less by fp16's, not at all in fp32; fp32's bias is unresolved or negligible."""
    result = probe.main(probe_argv("audit", "--batches", "5", "--batch-size", "8"), engine)
    rows = {r["dtype"]: r for r in result["rows"]}
    assert all(r["sigma2"] > 0 and r["batches"] == 5 for r in rows.values())
    dev = {k: r["seq_weight_abs_dev"] for k, r in rows.items()}
    assert dev["bf16"] > dev["fp16"] > 100 * dev["fp32"], dev
    assert rows["bf16"]["mismatch_logp_abs_mean"] > rows["fp16"]["mismatch_logp_abs_mean"]
    assert not rows["fp32"]["resolved"] or rows["fp32"]["bias_norm"] < 1e-4 * math.sqrt(rows["fp32"]["sigma2"])


def test_campaign_runs_once_skips_what_is_done_and_resumes(warm_dir, tmp_path):
    """The runner in fresh processes on a one-run plan: the run's small files land in
    results/<machine>/NAME; run again, nothing runs; with its results gone but its checkpoint there,
    it is resumed (no step redone) and its files come back identical."""
    import subprocess
    import sys
    from conftest import ROOT, tiny_args
    import warm_start
    from experiments import campaign
    from instruments import machine
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
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


def test_trainer_half_needs_no_engine_and_orders_the_formats():
    """probe.py trainer (the GPU check where vLLM is not): the held-out answers' tokens, each 16-bit
    trainer against float32 on this CPU; fp16's log-prob error and its logits' are a fraction of
    bf16's; the loss scale brings fp16's gradient nearer float32's; no GPU, so no cross rows and no
    --gpu-ablation."""
    result = probe.main(["trainer"])
    assert result["tokens"] == task.N_EVAL * (2 * 12 - 1 + 1) and not result["cross_rows"]
    err = {r["trainer"]: r["mismatch_logp_abs_mean"] for r in result["rows"] if r["device"] == "cpu"}
    assert 0 < 2 * err["fp16"] < err["bf16"], err
    layers = result["layers"]["cpu"]
    assert all(0 < e < 1 for e in layers["bf16"] + layers["fp16"]) and layers["fp16"][-1] < layers["bf16"][-1]
    grads = {(g["trainer"], g["loss_scale"]): g for g in result["grads"]}
    assert grads["fp16", probe.INIT_SCALE]["rel_error"] < grads["fp16", 1.0]["rel_error"], grads
    with pytest.raises(SystemExit) as refused:  # the GPU's kernels swapped: on a GPU alone
        probe.main(["trainer", "--gpu-ablation", "both"])
    assert refused.value.code == 2 and result["gpu_ablation"] == "none"


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
