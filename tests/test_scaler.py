"""experiments/scaler.py: a real fp16 backward loses gradient to underflow without loss scaling."""
import scaler


def test_fp16_backward_loses_gradient_to_underflow_without_loss_scaling(engine, varied_reward):
    """A real fp16 backward through the 16-bit trainer, one GRPO batch: unscaled, most entries of the
    logits' gradient underflow (0 or subnormal); at the GradScaler's initial scale far fewer do, and the
    weights' gradient is closer to float32's; 2**24 overflows."""
    from precision import INIT_SCALE
    result = scaler.main(["--group-size", "4", "--batch-size", "16"], engine)
    rows = {(r["dtype"], r["loss_scale"]): r for r in result["rows"]}
    plain, scaled = rows[("fp16", 1.0)], rows[("fp16", INIT_SCALE)]
    assert plain["logit_grad_underflow"] > 0.5 and scaled["logit_grad_underflow"] < plain["logit_grad_underflow"] / 10, rows
    assert scaled["logit_grad_zero"] <= plain["logit_grad_zero"] and scaled["weight_grad_zero"] <= plain["weight_grad_zero"]
    assert scaled["rel_error"] < plain["rel_error"], rows
    assert not rows[("fp16", 2.0 ** 24)]["finite"] and rows[("bf16", 1.0)]["finite"]
