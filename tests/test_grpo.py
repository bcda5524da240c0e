"""The hand-written GRPO loss, the GradScaler update, the warm start and a few real RL steps."""
import json
import math
import os

import pytest
import torch

import harness
import plot
import probe
import train_grpo
from conftest import tiny_args
from precision import INIT_SCALE, get_precision, mismatch_metrics
from train_grpo import group_advantages, grpo_loss, unscale_clip_step

def loss_of(*args, **kwargs):
    return grpo_loss(*args, **kwargs)[0]


# Two sequences of three response tokens; the second one's last token is padding.
MASK = torch.tensor([[1., 1., 1.], [1., 1., 0.]])
ADV = torch.tensor([1.0, -1.0])


def test_group_advantages():
    r = torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.])
    # group 1: mean 0.25, unbiased std 0.5; group 2: every reward equal -> no signal
    assert torch.allclose(group_advantages(r, 4), torch.tensor([1.5, -.5, -.5, -.5, 0., 0., 0., 0.]), atol=1e-5)
    assert torch.allclose(group_advantages(r, 4, scale_by_std=False), torch.tensor([.75, -.25, -.25, -.25, 0, 0, 0, 0]))


def test_ppo_clipping_both_sides_masking_and_token_mean():
    old = torch.log(torch.tensor([[0.2, 0.4, 0.5], [0.2, 0.4, 0.5]]))
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    logp = (old + ratio.log()).requires_grad_()
    loss = loss_of(logp, old, old, ADV, MASK, clip_eps=0.2)
    # A=+1: -min(r, clip r) = -1.2, -0.5, -1.0 ; A=-1: -min(-r, -clip r) = 1.5, 0.8, (masked)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0 + 1.5 + 0.8) / 5, abs=1e-6)
    loss.backward()
    # clipped tokens (A>0, r>1+eps) and (A<0, r<1-eps) get no gradient; d/dlogp = -A r / n_tokens otherwise
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [1.5 / 5, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_zero_advantage_gives_zero_gradient():
    old = torch.log(torch.full((2, 3), 0.3))
    logp = old.clone().requires_grad_()
    loss_of(logp, old, old, torch.zeros(2), MASK).backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_leaving_out_zero_advantage_sequences_keeps_the_loss_and_gradient():
    """The loop drops A = 0 sequences from the backward but counts their tokens (n_tokens)."""
    torch.manual_seed(0)
    old = torch.randn(3, 3)
    mask, adv = torch.tensor([[1., 1., 1.], [1., 1., 0.], [1., 0., 0.]]), torch.tensor([1.0, 0.0, -2.0])
    full = old.clone().requires_grad_()
    loss_of(full, old, old, adv, mask).backward()
    keep = adv != 0
    part = old[keep].clone().requires_grad_()
    loss = loss_of(part, old[keep], old[keep], adv[keep], mask[keep], n_tokens=mask.sum())
    loss.backward()
    assert loss.item() == pytest.approx(loss_of(old, old, old, adv, mask).item(), abs=1e-7)
    assert torch.allclose(part.grad, full.grad[keep]) and torch.count_nonzero(full.grad[~keep]) == 0


def test_tis_weights_tokens_by_truncated_ratio_to_the_engine():
    old = torch.log(torch.full((2, 3), 0.3))
    mu = old - torch.log(torch.tensor([[3.0, 0.5, 1.0], [1.0, 4.0, 1.0]]))  # pi_old / mu
    loss = loss_of(old.clone(), old, mu, ADV, MASK, algorithm="token-tis", cap=2.0)
    # ratio 1; weights min(w, 2): [2, .5, 1] and [1, 2, (masked)]
    assert loss.item() == pytest.approx((-(2 + 0.5 + 1) + (1 + 2)) / 5, abs=1e-6)


def test_mis_drops_sequences_whose_weight_exceeds_the_cap():
    old = torch.log(torch.full((2, 3), 0.3))
    w = torch.tensor([[3.0, 0.5, 1.0], [3.0, 1.0, 100.0]])  # seq weights 1.5 (kept), 3.0 (dropped; 100 is padding)
    loss = loss_of(old.clone(), old, old - w.log(), ADV, MASK, algorithm="seq-mis", cap=2.0)
    assert loss.item() == pytest.approx(-1.5 * 3 / 5, abs=1e-6)
    assert loss_of(old.clone(), old, old - w.log(), ADV, MASK, algorithm="grpo").item() == pytest.approx((-3 + 2) / 5)


def test_pg_seq_is_weights_each_sequence_by_its_truncated_importance_ratio():
    """Plain policy gradient: loss = -sum_i w_i A_i sum_t log pi / n_tokens, w_i = min(prod_t pi/mu, C)."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    w_tok = torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 7.0]])  # pi / mu per token; the last one is padding
    mu = logp.detach() - w_tok.log()
    loss, stats = grpo_loss(logp, logp.detach(), mu, ADV, MASK, algorithm="pg-seq-is")  # C = inf
    w = torch.tensor([1.5, 4.0])  # products over response tokens only
    assert loss.item() == pytest.approx(-(1.5 * 3 * math.log(0.5) - 4.0 * 2 * math.log(0.4)) / 5, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -(w * ADV)[:, None] * MASK / 5, atol=1e-6)  # the weight carries no gradient
    assert stats["is_weight_max"] == pytest.approx(4.0) and stats["is_capped_frac"] == 0
    truncated, stats = grpo_loss(logp, logp.detach(), mu, ADV, MASK, algorithm="pg-seq-is", cap=2.0)
    assert truncated.item() == pytest.approx(-(1.5 * 3 * math.log(0.5) - 2.0 * 2 * math.log(0.4)) / 5, abs=1e-6)
    assert stats["is_capped_frac"] == 0.5


def test_pg_seq_mis_drops_sequences_above_the_cap_instead():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]]))
    mu = logp - torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 7.0]]).log()
    loss, stats = grpo_loss(logp, logp, mu, ADV, MASK, algorithm="pg-seq-mis")  # C = 3: 1.5 kept, 4.0 dropped
    assert loss.item() == pytest.approx(-1.5 * 3 * math.log(0.5) / 5, abs=1e-6) and stats["is_capped_frac"] == 0.5


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    old = torch.log(torch.full((2, 3), 0.3))
    # sequence 1 (A = +1): mean log-ratio 6e-4 > log(1 + 4e-4): clipped, no gradient;
    # sequence 2 (A = -1): mean log-ratio -1e-4, inside [1 - 3e-4, 1 + 4e-4]: not clipped.
    logp = (old + torch.tensor([[6e-4, 6e-4, 6e-4], [-1e-4, -1e-4, 5.0]])).requires_grad_()
    loss, stats = grpo_loss(logp, old, old, ADV, MASK, algorithm="gspo")
    s2 = math.exp(-1e-4)
    assert loss.item() == pytest.approx((-(1 + 4e-4) * 3 + s2 * 2) / 5, abs=1e-7)
    loss.backward()
    # d/dlogp of s2 * 2 tokens / 5, with s2 = exp(mean of 2 log-ratios): s2 * 2 / 5 * (1/2) per token
    assert torch.allclose(logp.grad, torch.tensor([[0., 0., 0.], [s2 / 5, s2 / 5, 0.]]), atol=1e-7)
    assert stats["clip_frac_pos"] == 1.0 and stats["clip_frac_neg"] == 0.0 and stats["clip_seq_frac"] == 0.5


def test_clip_fractions_are_split_by_the_sign_of_the_advantage():
    old = torch.log(torch.tensor([[0.2, 0.4, 0.5], [0.2, 0.4, 0.5]]))
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    _, stats = grpo_loss(old + ratio.log(), old, old, ADV, MASK, clip_eps=0.2)
    # A = +1: 1.5 is clipped (1 of 3 tokens); A = -1: 0.5 is clipped (1 of 2 tokens)
    assert stats["clip_frac_pos"] == pytest.approx(1 / 3) and stats["clip_frac_neg"] == pytest.approx(1 / 2)
    assert stats["clip_seq_frac"] == 1.0 and stats["ratio_dev_max"] == pytest.approx(0.5)


def test_k3_kl_penalty_is_zero_at_the_reference_and_positive_away():
    old = torch.log(torch.full((2, 3), 0.3))
    assert loss_of(old.clone(), old, old, torch.zeros(2), MASK, ref_logp=old, kl_coef=0.5).item() == 0
    r = 0.5  # ref / pi
    k3 = r - 1 - math.log(r)
    loss = loss_of(old.clone(), old, old, torch.zeros(2), MASK, ref_logp=old + math.log(r), kl_coef=0.5)
    assert loss.item() == pytest.approx(0.5 * k3, abs=1e-6)


def optimizer_step(model, opt, scaler, loss):  # grpo_step's lines: zero, scaled backward, step
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    return unscale_clip_step(model, opt, scaler, max_grad_norm=1.0)


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_nonfinite_gradient_step_is_skipped_and_weights_untouched(dtype):
    model, scaler = _tiny_model(), get_precision(dtype, "cpu").grad_scaler()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scale0 = scaler.get_scale()
    loss = (model(torch.ones(1, 4)) * torch.tensor([float("inf"), 1.0])).sum()
    _, skipped = optimizer_step(model, opt, scaler, loss)
    assert skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if dtype == "fp16":
        assert scaler.get_scale() == scale0 / 2  # dynamic loss scaling backs off
    # a clean step afterwards goes through and moves the weights
    grad_norm, skipped = optimizer_step(model, opt, scaler, model(torch.ones(1, 4)).sum())
    assert not skipped and math.isfinite(grad_norm)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warm_start_lowers_loss_and_is_cached(tmp_path):
    args = tiny_args(str(tmp_path))
    cfg = train_grpo.model_config(args)
    ckpt, losses = train_grpo.warm_start(args, cfg, "cpu")
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    ckpt2, losses2 = train_grpo.warm_start(args, cfg, "cpu")
    assert ckpt2 == ckpt and losses2 is None  # reused, not retrained
    other, _ = train_grpo.warm_start(tiny_args(str(tmp_path), "--seed", "1"), cfg, "cpu")
    assert other != ckpt  # the cache key covers the seed


KEYS = ["step", "reward_mean", "response_len_mean", "mismatch_k1", "mismatch_k3", "mismatch_prob_abs_max",
        "mismatch_prob_abs_mean", "mismatch_logp_abs_mean", "grad_norm", "loss_scale", "step_skipped",
        "time_rollout_s", "time_logprob_s", "time_train_s", "time_sync_s"]


def test_real_rl_steps_in_each_dtype(engine, warm_dir, varied_reward):
    k3 = {}
    for name, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
        out = os.path.join(warm_dir, name)
        args = tiny_args(warm_dir, "--dtype", name, "--steps", "3", "--batch-size", "4", "--group-size", "4",
                         "--eval-every", "2", "--out", out)
        train_grpo.train(args, llm=engine(vllm_dtype))
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            for k in KEYS:
                assert k in r and math.isfinite(float(r[k])), (name, k)
            assert r["grad_norm"] > 0
        assert "eval_accuracy" in rows[1] and "eval_accuracy" in rows[2]
        assert os.path.isfile(os.path.join(out, "hf", "model.safetensors"))
        k3[name] = sum(r["mismatch_k3"] for r in rows) / len(rows)
    assert k3["fp32"] * 100 <= k3["bf16"], k3
    assert k3["bf16"] > k3["fp16"] > 0, k3

    # plot.py draws these three real runs into one PNG, and reads each run's dtype from its args.json
    png = os.path.join(warm_dir, "rl.png")
    plot.main([os.path.join(warm_dir, d) for d in ("fp32", "bf16", "fp16")] + ["--out", png])
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert [plot.load_run(os.path.join(warm_dir, d))[0] for d in ("fp32", "bf16", "fp16")] == ["fp32", "bf16", "fp16"]
    with pytest.raises(SystemExit):
        plot.main([str(warm_dir), "--out", png])  # a folder that holds no run: one-line error
    # the seeds experiment's figure reads folders named ARM-DTYPE-sSEED (here one seed per dtype)
    exp = os.path.join(warm_dir, "exp")
    os.makedirs(exp)
    for d in ("fp32", "bf16", "fp16"):
        os.symlink(os.path.join(warm_dir, d), os.path.join(exp, f"grpo-{d}-s0"))
    plot.main(["--experiment", exp, "--out", os.path.join(warm_dir, "exp.png")])
    drawn = json.load(open(os.path.join(warm_dir, "exp.json")))["arms"]["grpo"]
    assert sorted(drawn) == ["bf16", "fp16", "fp32"] and len(drawn["fp16"]["curves"]["reward_mean"]["x"]) == 3


def probe_argv(warm_dir, experiment, *extra):
    return [experiment, "--sft-steps", "40", "--sft-batch", "32", "--n-eval", "16", "--group-size", "4",
            "--warmstart-dir", os.path.join(warm_dir, "warmstart"), *extra]


def test_offline_probe(engine, warm_dir):
    """Every engine x trainer pair on the (tiny) warm start: the matched 16-bit rows order as the
    formats' precision says, and the mismatch sits on the engine's and the trainer's rounding alike."""
    out = os.path.join(warm_dir, "probe.json")
    probe.main(probe_argv(warm_dir, "mismatch", "--json", out), engine)
    result = json.load(open(out))
    rows = {(r["engine"], r["trainer"]): r for r in result["rows"]}
    assert len(rows) == 15 and result["sequences_per_engine"] == 64 and result["machine"]["torch"]
    png = os.path.join(warm_dir, "probe.png")
    plot.main(["--probe", out, "--out", png])
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    k3 = {pair: r["mismatch_k3"] for pair, r in rows.items()}
    assert k3[("fp32", "fp32")] * 100 <= k3[("fp16", "fp16")] < k3[("bf16", "bf16")], k3
    assert k3[("bf16", "fp32")] > k3[("fp16", "fp32")] > k3[("fp32", "fp32")], k3  # engine-side rounding alone
    assert result["bf16_over_fp16"]["mismatch_k3"] == k3[("bf16", "bf16")] / k3[("fp16", "fp16")]
    assert {r["positions"] for r in result["by_position"]} >= {"0-7", "8-15"}


def test_fp16_backward_loses_gradient_to_underflow_without_loss_scaling(engine, warm_dir, varied_reward):
    """A real fp16 backward through the 16-bit trainer, one GRPO batch: unscaled, most entries of the
    logits' gradient underflow (stored as 0 or a subnormal, with fewer than fp16's 10 mantissa bits);
    at the GradScaler's initial scale almost none do, and the weights' gradient is closer to float32's;
    2**24 overflows."""
    result = probe.main(probe_argv(warm_dir, "scaler", "--batch-size", "16"), engine)
    rows = {(r["dtype"], r["loss_scale"]): r for r in result["rows"]}
    plain, scaled = rows[("fp16", 1.0)], rows[("fp16", INIT_SCALE)]
    assert plain["logit_grad_underflow"] > 0.5 and scaled["logit_grad_underflow"] < plain["logit_grad_underflow"] / 10, rows
    assert scaled["logit_grad_zero"] <= plain["logit_grad_zero"] and scaled["weight_grad_zero"] <= plain["weight_grad_zero"]
    assert scaled["rel_error"] < plain["rel_error"], rows
    assert not rows[("fp16", 2.0 ** 24)]["finite"] and rows[("bf16", 1.0)]["finite"]


def test_metrics_lines_are_strict_json_and_k3_is_accurate_at_float32s_floor():
    line = harness.json_line({"step": 3, "grad_norm": float("inf"), "loss": float("nan"), "reward_mean": 0.5})
    assert json.loads(line) == {"step": 3, "grad_norm": None, "loss": None, "reward_mean": 0.5,
                                "nonfinite": ["grad_norm", "loss"]}
    d = torch.tensor([[1e-8, -2e-8, 3e-9]], dtype=torch.float64)  # log mu - log pi, an fp32 run's size
    k3 = mismatch_metrics(d.float().double(), torch.zeros_like(d), torch.ones_like(d))["mismatch_k3"]
    # r - 1 - log r = d^2 / 2 + O(d^3): every term positive, none lost to rounding
    assert k3 > 0 and k3 == pytest.approx((d.float().double() ** 2 / 2).mean().item(), rel=1e-6)


def test_engine_behavior_logp_makes_the_ratio_pi_over_mu(engine, warm_dir, varied_reward):
    """--behavior-logp engine: pi_old is the engine's mu, so the first update's ratio pi_theta / pi_old
    is pi / mu itself: 1 to float32 precision when both sides are fp32, visibly not in bf16."""
    dev = {}
    for name, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        out = os.path.join(warm_dir, f"engine-{name}")
        args = tiny_args(warm_dir, "--dtype", name, "--steps", "2", "--batch-size", "4", "--group-size", "4",
                         "--behavior-logp", "engine", "--algorithm", "gspo", "--out", out)
        train_grpo.train(args, llm=engine(vllm_dtype))
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert all(math.isfinite(r["mismatch_k3"]) and "clip_frac_pos" in r for r in rows)
        dev[name] = rows[0]["ratio_dev_max"]
    assert dev["fp32"] < 1e-4 and dev["bf16"] > 1e-3, dev


def test_audit_bias_gradient_equals_the_direct_formula():
    """d = grad J - grad J_IS = grad of sum_i (1 - w_i) A_i sum_t log pi / N, w_i = prod_t pi / mu."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    mu = logp.detach() - torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 3.0]]).log()  # pi / mu per token
    J, J_bias, w = probe.audit_losses(logp, logp.detach(), mu, ADV, MASK, MASK.sum())
    assert torch.allclose(w, torch.tensor([1.5, 0.5]))  # the padding token's 3.0 is not counted
    g = torch.autograd.grad(J, logp, retain_graph=True)[0]
    d = torch.autograd.grad(J_bias, logp)[0]
    # (1 - w) A = (1 - 1.5) * 1 and (1 - 0.5) * -1: -0.5 on every response token, over 5 tokens
    assert torch.allclose(d, torch.tensor([[-0.5, -0.5, -0.5], [-0.5, -0.5, 0.]]) / 5)
    g_is = torch.autograd.grad(((w * ADV) * (logp * MASK).sum(1)).sum() / 5, logp)[0]
    assert torch.allclose(g - g_is, d)


def test_audit_fp32_bias_is_at_the_noise_floor_and_bf16_exceeds_fp16(engine, warm_dir, varied_reward):
    result = probe.main(probe_argv(warm_dir, "audit", "--batches", "3", "--batch-size", "8"), engine)
    rows = {r["dtype"]: r for r in result["rows"]}
    assert all(r["grad_noise"] > 0 for r in rows.values())
    fp32 = rows["fp32"]
    # mean d, before its noise is removed: at 3 small batches the denoised |b| may well be 0 for every dtype
    assert fp32["mean_d_norm"] <= 3 * fp32["bias_se"] or fp32["mean_d_norm"] < 1e-5 * fp32["grad_noise"], fp32
    assert rows["bf16"]["mean_d_norm"] > rows["fp16"]["mean_d_norm"] > fp32["mean_d_norm"], rows
    assert all(0 <= r["bias_norm"] <= r["mean_d_norm"] for r in rows.values()), rows
    assert {b["pi"] for b in result["by_pi"]} == {"0.0-0.01", "0.01-0.1", "0.1-0.5", "0.5-0.9", "0.9-1.0"}
