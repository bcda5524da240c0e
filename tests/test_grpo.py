"""grpo.py's hand-written loss and normalisers, the mini-batch step and the GradScaler update (against
hand-computed values), the warm start, and a few real RL steps."""
import itertools
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

import grpo
import instruments
import task
import train_grpo
import warm_start
from conftest import parity_reward, rl, tiny_args
from experiments import plot
from grpo import Batch, group_advantages, grpo_loss, loss_norm, optimizer_step
from instruments import loss as loss_stats
from model import GPT, GPTConfig, load_hf, pack, token_logprobs
from precision import get_precision

# Two sequences of three response tokens; the second one's last token is padding.
MASK = torch.tensor([[1., 1., 1.], [1., 1., 0.]])
ADV = torch.tensor([1.0, -1.0])


def rows_of(mu, adv, mask):
    return Batch(None, mask, mu, adv, {})


def loss_of(logp, old, mu, adv, mask, algorithm="grpo", cap=None, bypass=False, dr_grpo=False, budget=None):
    """(loss, parts) of grpo_loss, with the algorithm's own cap unless one is given."""
    norm = loss_norm(mask, algorithm, dr_grpo, budget)
    cap = grpo.CAPS.get(algorithm) if cap is None else cap
    return grpo_loss(logp, old, rows_of(mu, adv, mask), norm, algorithm, cap, bypass)


def test_group_advantages():
    r = torch.tensor([1., 0., 0., 0., 1., 1., 1., 1.])
    # group 1: mean 0.25, unbiased std 0.5; group 2: every reward equal -> no signal
    assert torch.allclose(group_advantages(r, 4), torch.tensor([1.5, -.5, -.5, -.5, 0., 0., 0., 0.]), atol=1e-5)
    assert torch.allclose(group_advantages(r, 4, scale_by_std=False), torch.tensor([.75, -.25, -.25, -.25, 0, 0, 0, 0]))


def test_ppo_clipping_both_sides_masking_and_token_mean():
    old = torch.log(torch.tensor([[0.2, 0.4, 0.5], [0.2, 0.4, 0.5]]))
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.5, 0.5, 1.0]])
    logp = (old + ratio.log()).requires_grad_()
    loss, _ = loss_of(logp, old, old, ADV, MASK)
    # A=+1: -min(r, clip r) = -1.2, -0.5, -1.0 ; A=-1: -min(-r, -clip r) = 1.5, 0.8, (masked)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0 + 1.5 + 0.8) / 5, abs=1e-6)
    loss.backward()
    # clipped tokens (A>0, r>1+eps) and (A<0, r<1-eps) get no gradient; d/dlogp = -A r / n_tokens otherwise
    expected = torch.tensor([[0.0, -0.5 / 5, -1.0 / 5], [1.5 / 5, 0.0, 0.0]])
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_zero_advantage_gives_zero_gradient():
    old = torch.log(torch.full((2, 3), 0.3))
    logp = old.clone().requires_grad_()
    loss_of(logp, old, old, torch.zeros(2), MASK)[0].backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_leaving_out_zero_advantage_sequences_keeps_the_loss_and_gradient():
    """The step drops A = 0 sequences from the backward but keeps them in the normaliser."""
    torch.manual_seed(0)
    old = torch.randn(3, 3)
    mask, adv = torch.tensor([[1., 1., 1.], [1., 1., 0.], [1., 0., 0.]]), torch.tensor([1.0, 0.0, -2.0])
    full = old.clone().requires_grad_()
    loss_of(full, old, old, adv, mask)[0].backward()
    keep = adv != 0  # as grpo_step selects its rows
    norm = loss_norm(mask, "grpo", False, None)
    part = old[keep].clone().requires_grad_()
    loss = grpo_loss(part, old[keep], rows_of(old[keep], adv[keep], mask[keep]), norm[keep])[0]
    loss.backward()
    assert loss.item() == pytest.approx(loss_of(old, old, old, adv, mask)[0].item(), abs=1e-7)
    assert torch.allclose(part.grad, full.grad[keep]) and torch.count_nonzero(full.grad[~keep]) == 0


def test_tis_weights_tokens_by_truncated_ratio_to_the_engine():
    old = torch.log(torch.full((2, 3), 0.3))
    mu = old - torch.log(torch.tensor([[3.0, 0.5, 1.0], [1.0, 4.0, 1.0]]))  # pi_old / mu
    loss = loss_of(old.clone(), old, mu, ADV, MASK, algorithm="token-tis", cap=2.0)[0]
    # ratio 1; weights min(w, 2): [2, .5, 1] and [1, 2, (masked)]
    assert loss.item() == pytest.approx((-(2 + 0.5 + 1) + (1 + 2)) / 5, abs=1e-6)


def test_mis_drops_sequences_whose_weight_exceeds_the_cap():
    old = torch.log(torch.full((2, 3), 0.3))
    w = torch.tensor([[3.0, 0.5, 1.0], [3.0, 1.0, 100.0]])  # seq weights 1.5 (kept), 3.0 (dropped; 100 is padding)
    loss = loss_of(old.clone(), old, old - w.log(), ADV, MASK, algorithm="seq-mis", cap=2.0)[0]
    assert loss.item() == pytest.approx(-1.5 * 3 / 5, abs=1e-6)
    assert loss_of(old.clone(), old, old - w.log(), ADV, MASK)[0].item() == pytest.approx((-3 + 2) / 5)


# pi_theta / mu per token for the bypass tests; pi_old = mu (--behavior-logp engine)
W_TOK = torch.tensor([[1.5, 0.5, 1.0], [1.0, 1.5, 9.0]])


def test_bypass_ppo_ratio_is_pi_theta_over_mu():
    """With pi_old = mu the PPO ratio already is pi_theta / mu: the correction (so the flags refuse a
    further token weight, test_hardening)."""
    logp = torch.log(torch.full((2, 3), 0.3))
    mu = logp - W_TOK.log()
    loss, parts = loss_of(logp, mu, mu, ADV, MASK, bypass=True)
    # A=+1: -min(r, clip r) = -[1.2, 0.5, 1.0]; A=-1: max(r, clip r) = [1.0, 1.5] (9.0 is padding)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0 + 1.0 + 1.5) / 5, abs=1e-6)
    assert torch.allclose(parts["ratio"] * MASK, W_TOK * MASK)


def test_bypass_seq_mis_keeps_only_its_rejection_mask():
    """seq-mis in bypass: PPO-clip on pi_theta / mu, each sequence kept whole or dropped by
    1[prod_t pi_theta / mu <= C]; no weight on top of the ratio."""
    logp = torch.log(torch.full((2, 3), 0.3))
    mu = logp - W_TOK.log()
    loss, parts = loss_of(logp, mu, mu, ADV, MASK, algorithm="seq-mis", bypass=True, cap=1.2)
    # sequence weights 1.5 * 0.5 * 1.0 = 0.75 (kept) and 1.0 * 1.5 = 1.5 > 1.2 (dropped)
    assert torch.allclose(parts["is_weight"].squeeze(1), torch.tensor([0.75, 1.5]))
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.0) / 5, abs=1e-6)
    loose = loss_of(logp, mu, mu, ADV, MASK, algorithm="seq-mis", bypass=True)[0]  # C = 10
    assert loose.item() == pytest.approx(loss_of(logp, mu, mu, ADV, MASK, bypass=True)[0].item())
    stats = loss_stats(parts, ADV, MASK, "seq-mis")
    assert stats["is_capped_frac"] == 0.5 and stats["is_weight_max"] == pytest.approx(1.5)


def test_pg_seq_is_weights_each_sequence_by_its_truncated_importance_ratio():
    """Plain policy gradient: loss = -sum_i w_i A_i sum_t log pi / n_tokens, w_i = min(prod_t pi/mu, C)."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    mu = logp.detach() - torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 7.0]]).log()  # the last one is padding
    loss, parts = loss_of(logp, logp.detach(), mu, ADV, MASK, algorithm="pg-seq-is")  # no cap
    assert loss.item() == pytest.approx(-(1.5 * 3 * math.log(0.5) - 4.0 * 2 * math.log(0.4)) / 5, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -(torch.tensor([1.5, 4.0]) * ADV)[:, None] * MASK / 5, atol=1e-6)  # w carries no gradient
    stats = loss_stats(parts, ADV, MASK, "pg-seq-is")
    assert stats["is_weight_max"] == pytest.approx(4.0) and stats["is_capped_frac"] == 0
    truncated, parts = loss_of(logp, logp.detach(), mu, ADV, MASK, algorithm="pg-seq-is", cap=2.0)
    assert truncated.item() == pytest.approx(-(1.5 * 3 * math.log(0.5) - 2.0 * 2 * math.log(0.4)) / 5, abs=1e-6)
    assert loss_stats(parts, ADV, MASK, "pg-seq-is")["is_capped_frac"] == 0.5


def test_pg_seq_mis_drops_sequences_above_the_cap_instead():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]]))
    mu = logp - torch.tensor([[1.5, 1.0, 1.0], [2.0, 2.0, 7.0]]).log()
    loss = loss_of(logp, logp, mu, ADV, MASK, algorithm="pg-seq-mis")[0]  # C = 3: 1.5 kept, 4.0 dropped
    assert loss.item() == pytest.approx(-1.5 * 3 * math.log(0.5) / 5, abs=1e-6)


def test_gspo_clips_one_length_normalised_ratio_per_sequence_and_averages_sequences():
    old = torch.log(torch.full((2, 3), 0.3))
    # sequence 1 (A = +1): mean log-ratio 6e-4 > log(1 + 4e-4): clipped, no gradient;
    # sequence 2 (A = -1): mean log-ratio -1e-4, inside [1 - 3e-4, 1 + 4e-4]: not clipped.
    logp = (old + torch.tensor([[6e-4, 6e-4, 6e-4], [-1e-4, -1e-4, 5.0]])).requires_grad_()
    loss, parts = loss_of(logp, old, old, ADV, MASK, algorithm="gspo")
    s2 = math.exp(-1e-4)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + s2) / 2, abs=1e-7)  # the mean over sequences of their means
    loss.backward()
    # d/dlogp of s2 / 2 with s2 = exp(mean of its 2 log-ratios): s2 / 2 * (1/2) per token
    assert torch.allclose(logp.grad, torch.tensor([[0., 0., 0.], [s2 / 4, s2 / 4, 0.]]), atol=1e-7)
    stats = loss_stats(parts, ADV, MASK, "gspo")
    assert stats["clip_frac_pos"] == 1.0 and stats["clip_frac_neg"] == 0.0 and stats["clip_seq_frac"] == 0.5


def test_gspo_weighs_sequences_of_different_lengths_the_same():
    mask = torch.tensor([[1., 1., 1., 1.], [1., 0., 0., 0.]])  # 4 tokens and 1 token, both A = +1
    logp = torch.log(torch.full((2, 4), 0.5)).requires_grad_()
    loss_of(logp, logp.detach(), logp.detach(), torch.tensor([1.0, 1.0]), mask, algorithm="gspo")[0].backward()
    per_sequence = (logp.grad * mask).sum(1)
    assert torch.allclose(per_sequence, torch.tensor([-0.5, -0.5]))  # the token mean would give -0.8 and -0.2


def test_dr_grpo_divides_each_sequence_sum_by_the_generation_budget():
    assert torch.equal(loss_norm(MASK, "grpo", dr_grpo=True, max_new_tokens=8), torch.full((2, 1), 1 / 16))
    old = torch.log(torch.full((2, 3), 0.3))
    loss = loss_of(old.clone(), old, old, ADV, MASK, dr_grpo=True, budget=8)[0]
    # ratio 1: -A per token; (-3 + 2) over 2 sequences x 8 tokens (not over the 5 tokens)
    assert loss.item() == pytest.approx((-3 + 2) / 16, abs=1e-7)


def test_clip_statistics_count_only_sequences_with_an_advantage():
    old = torch.log(torch.full((3, 3), 0.4))
    ratio = torch.tensor([[1.5, 1.0, 1.0], [1.0, 0.5, 1.0], [3.0, 3.0, 3.0]])
    mask, adv = torch.ones(3, 3), torch.tensor([1.0, -1.0, 0.0])  # the third has no gradient
    _, parts = loss_of(old + ratio.log(), old, old, adv, mask)
    stats = loss_stats(parts, adv, mask, "grpo")
    assert stats["clip_frac_pos"] == pytest.approx(1 / 3) and stats["clip_frac_neg"] == pytest.approx(1 / 3)
    assert stats["clip_seq_frac"] == 1.0 and stats["ratio_dev_max"] == pytest.approx(2.0)


def tiny_batch(n=8, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 256, (n, T), generator=g)
    mask = torch.zeros(n, T - 1)
    mask[:, 4:] = 1.0
    mask[::3, 7:] = 0.0  # different lengths
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 2.0, -2.0, 0.0])
    return Batch(idx, mask, torch.randn(n, T - 1, generator=g) * 0.1 - 2.0, adv, {})


def test_a_minibatch_step_equals_the_steps_by_hand():
    """--minibatches 2: the batch shuffled (seed_of), split in two, one optimizer step each, with
    pi_old fixed at the rollout: the second mini-batch's ratio is measured against the rollout's pi."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, n_hidden=96))
    twin = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, n_hidden=96))
    twin.load_state_dict(model.state_dict())
    batch, prec = tiny_batch(), get_precision("fp32", device="cpu")
    args = SimpleNamespace(algorithm="grpo", dr_grpo=False, max_new_tokens=6, is_cap=None, behavior_logp="trainer",
                           minibatches=2, seed=3, out="-")
    with torch.no_grad():
        pi_old = token_logprobs(model, batch.idx)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.5), prec.grad_scaler()
    stats = grpo.grpo_step(model, opt, scaler, prec, batch, pi_old, args, 5, instruments)

    order = torch.randperm(8, generator=torch.Generator().manual_seed(task.seed_of("minibatch", 3, 5)))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    for rows in (order[:4], order[4:]):
        mask, a = batch.mask[rows], batch.adv[rows, None]
        r = torch.exp(token_logprobs(twin, batch.idx[rows]) - pi_old[rows])  # against the rollout's pi, not the last step's
        loss = (-torch.min(r * a, r.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum()
        twin_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), grpo.MAX_GRAD_NORM)
        twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert stats["ratio_dev_max"] > 0  # the second mini-batch saw pi_theta move away from pi_old


def test_minibatches_are_m_parts_even_when_m_does_not_divide_the_rows():
    """torch.chunk(4) of 6 rows gives 3 pieces; tensor_split gives 4 (2, 2, 1, 1), every row once."""
    args = SimpleNamespace(minibatches=4, seed=0)
    parts = grpo.minibatch_rows(6, args, step=0)
    assert [len(p) for p in parts] == [2, 2, 1, 1]
    assert sorted(torch.cat(parts).tolist()) == list(range(6))


def test_statistics_over_minibatches_are_the_whole_batchs():
    """With 4 mini-batches the reported maximum importance weight is the batch's maximum (not a
    mean of maxima) and the mean counts every response token once, as computed here directly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, n_hidden=96))
    batch, prec = tiny_batch(), get_precision("fp32", device="cpu")
    args = SimpleNamespace(algorithm="token-tis", dr_grpo=False, max_new_tokens=6, is_cap=2.0,
                           behavior_logp="trainer", minibatches=4, seed=0, out="-")
    with torch.no_grad():
        pi_old = token_logprobs(model, batch.idx)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), prec.grad_scaler()
    stats = grpo.grpo_step(model, opt, scaler, prec, batch, pi_old, args, 0, instruments)
    tokens = batch.mask.bool() & (batch.adv != 0)[:, None]
    w = torch.exp(pi_old - batch.mu_logp)[tokens]
    assert stats["is_weight_max"] == pytest.approx(w.max().item(), rel=1e-6)
    assert stats["is_weight_mean"] == pytest.approx(w.mean().item(), rel=1e-6)
    assert stats["is_capped_frac"] == pytest.approx((w > 2.0).float().mean().item())


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_nonfinite_gradient_step_is_skipped_and_weights_untouched(dtype):
    torch.manual_seed(0)
    model, scaler = torch.nn.Linear(4, 2), get_precision(dtype, device="cpu").grad_scaler()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scale0 = scaler.get_scale()
    _, skipped = optimizer_step(model, opt, scaler, (model(torch.ones(1, 4)) * torch.tensor([float("inf"), 1.0])).sum())
    assert skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if dtype == "fp16":
        assert scaler.get_scale() == scale0 / 2  # dynamic loss scaling backs off
    grad_norm, skipped = optimizer_step(model, opt, scaler, model(torch.ones(1, 4)).sum())  # a clean step goes through
    assert not skipped and math.isfinite(grad_norm)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warm_start_lowers_loss(tmp_path):
    args = tiny_args(str(tmp_path))
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    ckpt = warm_start.warm_start(cfg, args.n_items, 0, "cpu")
    batch = task.make_splits(0, args.n_items, 8)[1](("check",), 16)
    idx, mask, _ = pack([task.prompt_ids(p) for p, _ in batch], [task.answer_ids(a) for _, a in batch], "cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        nll = {name: -(token_logprobs(m, idx) * mask).sum().item() / mask.sum().item() for name, m in
               (("init", GPT(cfg)), ("warm", load_hf(ckpt)))}
    assert nll["warm"] < 0.5 * nll["init"], nll


def test_warm_start_is_cached_per_seed(tmp_path):
    args = tiny_args(str(tmp_path))
    cfg = warm_start.model_config(args.n_items, args.max_new_tokens)
    ckpt = warm_start.warm_start(cfg, args.n_items, 0, "cpu")
    mtime = os.path.getmtime(os.path.join(ckpt, "model.safetensors"))
    assert warm_start.warm_start(cfg, args.n_items, 0, "cpu") == ckpt  # reused, not retrained
    assert os.path.getmtime(os.path.join(ckpt, "model.safetensors")) == mtime
    assert warm_start.warm_start(cfg, args.n_items, 1, "cpu") != ckpt  # the cache key covers the seed


KEYS = ["step", "reward_mean", "response_len_mean", "mismatch_k1", "mismatch_k3", "mismatch_prob_abs_max",
        "mismatch_prob_abs_mean", "mismatch_logp_abs_mean", "grad_norm", "loss_scale", "step_skipped",
        "time_rollout_s", "time_logprob_s", "time_train_s", "time_sync_s", "logp_mean"]
INSTRUMENT_KEYS = ["resid_rms", "hidden_rms", "logit_rms", "logit_abs_max", "entropy_mean", "weight_rms",
                   "clip_frac_pos", "clip_frac_neg", "clip_seq_frac", "ratio_dev_max"]


@pytest.fixture(scope="module")
def dtype_runs(engine, warm_dir):
    """Three real runs of three steps, one per dtype, with the experiments' instruments on (as
    campaign.py runs them): {dtype: rows}, in one folder for plot.py."""
    exp = os.path.join(warm_dir, "exp")
    os.makedirs(exp)
    runs = {}
    with pytest.MonkeyPatch.context() as mp:  # varied_reward, for a module-scoped fixture
        mp.setattr(task, "reward", parity_reward)
        for name, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16")):
            out = os.path.join(exp, f"grpo-{name}-s0")
            args = tiny_args(warm_dir, "--dtype", name, *rl(3), "--out", out)
            train_grpo.train(args, llm=engine(vllm_dtype), instruments=instruments, record={"machine": instruments.machine()})
            runs[name] = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            assert os.path.isfile(os.path.join(out, "hf", "model.safetensors"))
    return exp, runs


def test_real_rl_steps_in_each_dtype_order_their_mismatch(dtype_runs):
    _, runs = dtype_runs
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            for k in KEYS + INSTRUMENT_KEYS:
                assert k in r and math.isfinite(float(r[k])), (name, k)
            assert r["grad_norm"] > 0
        assert "eval_accuracy_before" in rows[0] and "eval_accuracy" in rows[2]
    k3 = {name: sum(r["mismatch_k3"] for r in rows) / len(rows) for name, rows in runs.items()}
    assert k3["fp32"] * 100 <= k3["bf16"], k3
    assert k3["bf16"] > k3["fp16"] > 0, k3


def test_pi_buckets_add_up_to_the_mean_mismatch(dtype_runs):
    """The shift-share identity: mean |d| = sum over buckets of share x mean, in every row."""
    for rows in dtype_runs[1].values():
        for r in rows:
            shares, sizes = r["pi_bucket_frac"], r["pi_bucket_logp_abs_mean"]
            assert sum(shares) == pytest.approx(1.0)
            total = sum(f * s for f, s in zip(shares, sizes) if s is not None)
            assert total == pytest.approx(r["mismatch_logp_abs_mean"], rel=1e-9)


def test_plot_draws_real_runs(dtype_runs, warm_dir):
    """plot.py reads each run's variant from args.json (one seed each: no s.e.)."""
    exp, runs = dtype_runs
    plot.main(["experiment", exp, "--out", os.path.join(warm_dir, "exp.png")])
    drawn = json.load(open(os.path.join(warm_dir, "exp.json")))["arms"]["grpo"]
    assert sorted(drawn) == ["bf16", "fp16", "fp32"]
    assert drawn["fp16"]["curves"]["reward_mean"]["mean"] == [r["reward_mean"] for r in runs["fp16"]]
    assert open(os.path.join(warm_dir, "exp.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_paired_differences_by_hand():
    diffs = [0.01, 0.02, -0.01, 0.02]
    d = plot.paired([0.96, 0.97, 0.95, 0.98], [0.95, 0.95, 0.96, 0.96])
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.01)
    assert d["se"] == pytest.approx(math.sqrt(((0.0 ** 2 + 0.01 ** 2 + 0.02 ** 2 + 0.01 ** 2) / 3) / 4))
    # the sign-flip test by enumeration: of the 16 sign patterns of (.01, .02, -.01, .02), the means at least
    # as far from 0 as the observed .01: .01 (as observed), .015 (-.01 flipped), .01 (the first .01 and the -.01
    # flipped), and the 3 mirrors: 6 of 16
    means = [abs(sum(s * x for s, x in zip(signs, diffs)) / 4) for signs in itertools.product((1, -1), repeat=4)]
    assert d["p_sign_flip"] == sum(m >= 0.01 - 1e-12 for m in means) / 16 == 6 / 16
    assert d["ci95"][0] < 0.01 < d["ci95"][1]


def test_metrics_lines_are_strict_json(tmp_path):
    rec = {"step": 3, "grad_norm": float("inf"), "loss": float("nan"), "reward_mean": 0.5, "mismatch_k3": 0.0,
           "loss_scale": 1.0, "step_skipped": True, "time_step_s": 1.0}
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    train_grpo.log_step(str(tmp_path), 3, rec, model, opt, get_precision("fp16", device="cpu").grad_scaler())
    assert json.loads(open(tmp_path / "metrics.jsonl").read()) == {**rec, "grad_norm": None, "loss": None,
                                                                   "nonfinite": ["grad_norm", "loss"]}
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 4  # the next step to take


def test_engine_behavior_logp_makes_the_ratio_pi_over_mu(engine, warm_dir, varied_reward):
    """--behavior-logp engine: pi_old is the engine's mu, so the first update's ratio pi_theta / pi_old
    is pi / mu itself: 1 to float32 precision when both sides are fp32, visibly not in bf16."""
    dev = {}
    for name, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        out = os.path.join(warm_dir, f"engine-{name}")
        args = tiny_args(warm_dir, "--dtype", name, *rl(2), "--behavior-logp", "engine", "--algorithm", "gspo", "--out", out)
        train_grpo.train(args, llm=engine(vllm_dtype), instruments=instruments)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert all(math.isfinite(r["mismatch_k3"]) and "clip_frac_pos" in r for r in rows)
        dev[name] = rows[0]["ratio_dev_max"]
    assert dev["fp32"] < 1e-4 and dev["bf16"] > 1e-3, dev


def test_paper_recipe_and_fixes_run_end_to_end(engine, warm_dir, varied_reward):
    """Dr. GRPO with 4 mini-batches (the clip then acts), a bf16 trainer with an fp32 engine, and
    bf16 with the fp32 LM head on both sides: real steps, finite metrics."""
    for extra, llm in ((["--dr-grpo", "--minibatches", "4"], engine("bfloat16")),
                       (["--engine-dtype", "fp32"], engine("float32")),
                       (["--lm-head", "fp32"], engine("bfloat16", True))):
        out = os.path.join(warm_dir, "recipe-" + "-".join(x.strip("-") for x in extra))
        train_grpo.train(tiny_args(warm_dir, "--dtype", "bf16", *rl(2), *extra, "--out", out), llm=llm,
                         instruments=instruments)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), extra
        if "--minibatches" in extra:
            assert max(r["ratio_dev_max"] for r in rows) > 0  # later mini-batches move away from pi_old
