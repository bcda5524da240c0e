"""grpo.py: the hand-written loss and normalisers, the mini-batch step, the clip fraction and the
GradScaler step, against hand-computed values."""
import math

import pytest
import torch

import grpo
import instruments
import task
from grpo import Batch, group_advantages, grpo_loss, loss_norm, optimizer_step
from instruments import loss as loss_stats
from model import GPT, GPTConfig, token_logprobs
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
    update = grpo.Update("grpo", None, bypass=False, dr_grpo=False, budget=6, minibatches=2, seed=3)
    with torch.no_grad():
        pi_old = token_logprobs(model, batch.idx)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.5), prec.grad_scaler()
    stats = grpo.grpo_step(model, opt, scaler, prec, batch, pi_old, update, 5, instruments)

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


def test_every_row_carries_the_clipped_share_of_all_response_tokens():
    """The clip fraction, also under verl's and TRL's names: GSPO with pi_old = mu binds on whole
    sequences here (the random model is far from mu), counted on each of their tokens, over every
    response token of the batch (the A = 0 rows left out of the forward included)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, n_hidden=96))
    batch, prec = tiny_batch(), get_precision("fp32", device="cpu")
    with torch.no_grad():
        pi = token_logprobs(model, batch.idx)
    r = torch.exp(((pi - batch.mu_logp) * batch.mask).sum(1) / batch.mask.sum(1))
    a = batch.adv
    binds = torch.where(a > 0, r > 1 + grpo.GSPO_CLIP[1], r < 1 - grpo.GSPO_CLIP[0]) & (a != 0)
    expected = (binds[:, None] * batch.mask).sum().item() / batch.mask.sum().item()
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), prec.grad_scaler()
    stats = grpo.grpo_step(model, opt, scaler, prec, batch, pi, grpo.Update("gspo", bypass=True), 0)
    assert 0 < expected < 1
    assert stats["clip_frac"] == pytest.approx(expected, rel=1e-12)
    assert stats["clip_frac"] == stats["actor/pg_clipfrac"] == stats["clip_ratio/region_mean"]


def test_minibatches_are_m_parts_even_when_m_does_not_divide_the_rows():
    """torch.chunk(4) of 6 rows gives 3 pieces; tensor_split gives 4 (2, 2, 1, 1), every row once."""
    parts = grpo.minibatch_rows(6, grpo.Update(minibatches=4, seed=0), step=0)
    assert [len(p) for p in parts] == [2, 2, 1, 1]
    assert sorted(torch.cat(parts).tolist()) == list(range(6))


def test_statistics_over_minibatches_are_the_whole_batchs():
    """With 4 mini-batches the reported maximum importance weight is the batch's maximum (not a
    mean of maxima) and the mean counts every response token once, as computed here directly."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, n_hidden=96))
    batch, prec = tiny_batch(), get_precision("fp32", device="cpu")
    update = grpo.Update("token-tis", 2.0, bypass=False, dr_grpo=False, budget=6, minibatches=4, seed=0)
    with torch.no_grad():
        pi_old = token_logprobs(model, batch.idx)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), prec.grad_scaler()
    stats = grpo.grpo_step(model, opt, scaler, prec, batch, pi_old, update, 0, instruments)
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
