"""precision.py: the dtype decisions, the CPU's tensor-core emulation, the GradScaler's behaviour, and
the mismatch metrics against hand-computed values."""
import math

import pytest
import torch

from precision import GROWTH_INTERVAL, INIT_SCALE, TensorCoreMatmuls, get_precision, mismatch_metrics


def test_one_flag_decides_both_sides_and_the_engine_can_differ():
    p = get_precision("bf16", device="cpu")
    assert (p.dtype, p.engine_dtype, p.vllm_dtype, p.head_fp32) == (torch.bfloat16, torch.bfloat16, "bfloat16", False)
    q = get_precision("bf16", engine="fp32", lm_head="fp32", device="cpu")
    assert (q.dtype, q.engine_dtype, q.vllm_dtype, q.head_fp32) == (torch.bfloat16, torch.float32, "float32", True)


def test_the_fp16_scaler_starts_at_init_scale_and_doubles_after_clean_steps():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = get_precision("fp16", device="cpu").grad_scaler()
    assert scaler.get_scale() == INIT_SCALE
    for step in range(GROWTH_INTERVAL):
        assert scaler.get_scale() == INIT_SCALE, step
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2 * INIT_SCALE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_matmul_is_the_exact_product_of_16_bit_inputs_rounded_once(dtype):
    """As a tensor core: inputs rounded to 16 bits, products and sums in float32, one rounding at the end.
    The reference rounds the same way by hand in float64; a plain 16-bit CPU matmul is not asked."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=gen), torch.randn(64, 5, generator=gen)
    with TensorCoreMatmuls(dtype, strict=False):
        out = a @ b
    reference = (a.to(dtype).double() @ b.to(dtype).double()).to(dtype)
    assert out.dtype == dtype
    # float32 accumulation differs from float64's in the last float32 bits; 16-bit rounding hides it
    # except at a rounding boundary: at most one 16-bit step apart, almost always equal.
    step = torch.finfo(dtype).eps * reference.double().abs()
    assert ((out.double() - reference.double()).abs() <= step).all()
    assert (out == reference).float().mean() > 0.95


def test_the_backward_rounds_each_gradient_to_16_bits():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    with TensorCoreMatmuls(torch.float16, strict=False):
        (x @ w).float().sum().backward()
    assert torch.equal(w.grad, w.grad.half().float())  # every entry representable in fp16


def test_strict_mode_refuses_a_silent_promotion_to_float32():
    """The 16-bit trainer: a 16-bit activation meeting a float32 tensor would quietly run in float32.
    An explicit cast (the float32 islands) is allowed, and so is a matmul of float32 inputs (the fp32 head)."""
    h, w32 = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(4, 4)
    with TensorCoreMatmuls(torch.bfloat16, strict=True):
        with pytest.raises(RuntimeError, match="float32"):
            h * torch.ones(4)
        assert h.float().dtype == torch.float32
        assert (h.float() @ w32).dtype == torch.float32


def test_mismatch_metrics_by_hand():
    """Two tokens (the third is padding): log mu - log pi = d = (+0.1, -0.2)."""
    pi = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    mu = pi + torch.tensor([[0.1, -0.2, 5.0]])
    m = mismatch_metrics(mu, pi, torch.tensor([[1.0, 1.0, 0.0]]))
    r = [math.exp(-0.1), math.exp(0.2)]  # pi / mu
    assert m["mismatch_k1"] == pytest.approx((0.1 - 0.2) / 2)
    assert m["mismatch_k3"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 2)
    assert m["mismatch_logp_abs_mean"] == pytest.approx(0.15)
    assert m["mismatch_seq_logratio_abs"] == pytest.approx(0.1)
    probs = [abs(0.5 * math.exp(0.1) - 0.5), abs(0.25 * math.exp(-0.2) - 0.25)]
    assert m["mismatch_prob_abs_mean"] == pytest.approx(sum(probs) / 2)
    assert m["mismatch_prob_abs_max"] == pytest.approx(max(probs))
    assert m["logp_mean"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2)
    # the frameworks' names: verl's k3 over log(pi / mu), its |pi - mu|; TRL's |log pi - log mu|
    assert m["rollout_corr/k3_kl"] == pytest.approx(m["mismatch_k3"], rel=1e-5)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(sum(probs) / 2, rel=1e-5)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx(0.15, rel=1e-5)


def test_k3_is_accurate_at_float32s_floor():
    """An fp32 run's log-ratios are ~1e-8: r - 1 - log r = d^2 / 2 + O(d^3), every term positive and
    none lost to rounding (exp(x) - 1 - x in float32 would return 0 or noise)."""
    d = torch.tensor([[1e-8, -2e-8, 3e-9]], dtype=torch.float64).float().double()
    k3 = mismatch_metrics(d, torch.zeros_like(d), torch.ones_like(d))["mismatch_k3"]
    assert k3 > 0 and k3 == pytest.approx((d ** 2 / 2).mean().item(), rel=1e-6)
