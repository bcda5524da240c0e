"""experiments/audit.py: the bias gradient, the pairwise statistics and the jackknife by hand, and
the real audit where the mismatch is."""
import math

import numpy as np
import pytest
import torch

import audit
import common
from grpo import Batch
from instruments import machine
from variants import VARIANTS, runs_on

# Two sequences of three response tokens; the second one's last token is padding.
MASK = torch.tensor([[1., 1., 1.], [1., 1., 0.]])
ADV = torch.tensor([1.0, -1.0])


def test_audit_bias_gradient_equals_the_direct_formula():
    """d = grad J - grad J_IS = grad of sum_i (1 - w_i) A_i sum_t log pi / N, w_i = prod_t pi / mu."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    mu = logp.detach() - torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 3.0]]).log()  # pi / mu per token
    J, J_bias, w = audit.audit_losses(logp, logp.detach(), mu, ADV, MASK, MASK.sum())
    assert torch.allclose(w, torch.tensor([1.5, 0.5]))  # the padding token's 3.0 is not counted
    g = torch.autograd.grad(J, logp, retain_graph=True)[0]
    d = torch.autograd.grad(J_bias, logp)[0]
    assert torch.allclose(d, torch.tensor([[-0.5, -0.5, -0.5], [-0.5, -0.5, 0.]]) / 5)
    g_is = torch.autograd.grad(((w * ADV) * (logp * MASK).sum(1)).sum() / 5, logp)[0]
    assert torch.allclose(g - g_is, d)


def test_gspo_bias_gradient_by_hand():
    """gspo-engine's first update: with pi_old = pi every ratio is 1; with pi_old = mu, sequence 1
    (A = +1, mean log pi/mu = 1e-3 > log 1.0004) is clipped and drops out, sequence 2 (A = -1,
    1e-4, inside the window) keeps its ratio r. GSPO's loss is sum_i -min(r_i A_i, clip) / N, so
    d = grad(J_mu - J_pi) is -1/(3 N) on sequence 1's tokens and (1 - r) / (2 N) on sequence 2's;
    the ratio's value is the 16-bit pi's, its gradient the float32 logp's."""
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.4, 0.4, 0.9]])).requires_grad_()
    pi = logp.detach() + 0.01  # the trainer in 16 bits: another value, no gradient of its own
    mu = pi - torch.tensor([[1e-3, 1e-3, 1e-3], [1e-4, 1e-4, 5.0]])  # the padding's 5.0: not counted
    batch = Batch(None, MASK, mu, ADV, {})
    J, J_bias, clipped = audit.gspo_audit_losses(logp, pi, batch, budget=3)
    assert clipped.flatten().tolist() == [True, False]
    r = math.exp(1e-4)
    d = torch.autograd.grad(J_bias, logp, retain_graph=True)[0]
    assert torch.allclose(d, torch.tensor([[-1 / 6] * 3, [(1 - r) / 4, (1 - r) / 4, 0]]))
    g = torch.autograd.grad(J, logp)[0]
    assert torch.allclose(g, torch.tensor([[1 / 6] * 3, [-1 / 4, -1 / 4, 0]]))
    same = Batch(None, MASK, pi, ADV, {})  # no mismatch: d is 0
    assert audit.gspo_audit_losses(logp, pi, same, budget=3)[1].item() == 0


def test_bias_statistics_by_hand():
    """Pairwise (U-statistic) estimates from Gram matrices: unbiased where |mean d|^2 is not, and the
    cross term E d . E g uses d and g of different batches only."""
    d = torch.tensor([[1., 0.], [3., 0.], [0., 2.], [0., -2.]], dtype=torch.float64)  # K = 4 batches, 2 weights
    g = torch.tensor([[1., 1.], [1., -1.], [2., 0.], [0., 2.]], dtype=torch.float64)
    s = audit.bias_statistics(d @ d.T, g @ g.T, d @ g.T)
    pairs = [(j, k) for j in range(4) for k in range(4) if j != k]
    assert s["b2"] == pytest.approx(sum((d[j] @ d[k]).item() for j, k in pairs) / 12)
    assert s["b_dot_eg"] == pytest.approx(sum((d[j] @ g[k]).item() for j, k in pairs) / 12)
    assert s["sigma2"] == pytest.approx(((g - g.mean(0)) ** 2).sum().item() / 3)
    # noise along b: each batch's g against the other three batches' summed d, e.g. batch 2: d_0 + d_1 + d_3
    # = (4, -2), g_2 . (4, -2) / sqrt 20 = 8 / sqrt 20; then the variance (ddof 1) over the four batches
    along = [1.0, 1.0, 8 / math.sqrt(20), 4 / math.sqrt(20)]
    assert s["noise_along_b"] == pytest.approx(torch.tensor(along).var().item())
    relabelled = torch.tensor([2, 0, 3, 1])  # the same batches in another order: the same figure
    s2 = audit.bias_statistics(*((x[relabelled] @ y[relabelled].T) for x, y in ((d, d), (g, g), (d, g))))
    assert s2["noise_along_b"] == pytest.approx(s["noise_along_b"])


def test_jackknife_interval_by_hand():
    """The interval of sigma2 (tr Cov g), recomputed from the vectors themselves: sigma2 with each batch
    left out, the jackknife s.e. sqrt((K-1)/K sum (x_i - mean)^2), and t(K-1) either side."""
    gen = torch.Generator().manual_seed(0)
    d, g = (torch.randn(6, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    out = audit.jackknife(d @ d.T, g @ g.T, d @ g.T)
    tr_cov = lambda x: ((x - x.mean(0)) ** 2).sum().item() / (len(x) - 1)  # noqa: E731
    leave = np.array([tr_cov(g[torch.arange(6) != i]) for i in range(6)])
    se = math.sqrt(5 / 6 * ((leave - leave.mean()) ** 2).sum())
    assert out["sigma2"] == pytest.approx(tr_cov(g))
    assert out["sigma2_ci"] == pytest.approx((tr_cov(g) - common.t_quantile(5) * se, tr_cov(g) + common.t_quantile(5) * se))


def test_audit_measures_bias_where_the_mismatch_is(engine, varied_reward):
    """The real audit on the tiny warm start: the sequence weights pi / mu stray from 1 by bf16's
    rounding, far less by fp16's, not at all in fp32; fp32's bias is unresolved or negligible."""
    result = audit.main(["--group-size", "4", "--batches", "5", "--batch-size", "8"], engine)
    rows = {r["dtype"]: r for r in result["rows"]}
    assert all(r["sigma2"] > 0 and r["batches"] == 5 for r in rows.values())
    dev = {k: r["seq_weight_abs_dev"] for k, r in rows.items()}
    assert dev["bf16"] > dev["fp16"] > 100 * dev["fp32"], dev
    assert rows["bf16"]["mismatch_logp_abs_mean"] > rows["fp16"]["mismatch_logp_abs_mean"]
    assert not rows["fp32"]["resolved"] or rows["fp32"]["bias_norm"] < 1e-4 * math.sqrt(rows["fp32"]["sigma2"])


def test_the_gspo_audit_sees_the_clip_drop_sequences_in_bf16_none_in_fp32(engine, varied_reward):
    """gspo-engine's first update on the tiny warm start: bf16's mismatch puts sequences outside GSPO's
    window (the clip drops them), fp32's ~1e-8 none, and fp32's bias is negligible."""
    result = audit.main(["--loss", "gspo-engine", "--group-size", "4", "--batches", "5",
                         "--batch-size", "8"], engine)
    rows = {r["dtype"]: r for r in result["rows"]}
    assert result["loss"] == "gspo-engine" and rows["fp32"]["clipped_share"] == 0
    assert rows["bf16"]["clipped_share"] > 0
    assert not rows["fp32"]["resolved"] or rows["fp32"]["bias_norm"] < 1e-4 * math.sqrt(rows["fp32"]["sigma2"])


def test_a_variant_this_chip_cannot_run_is_refused_in_one_line(capsys):
    """--variant takes variants.py's record; one this chip's ISA cannot run: exit 2, one line."""
    isa = machine()["cpu_isa"]
    name = next(n for n in audit.KERNEL_VARIANTS if not runs_on(VARIANTS[n], isa))
    with pytest.raises(SystemExit) as e:
        audit.main(["--variant", name, "--loss", "gspo-engine"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1
