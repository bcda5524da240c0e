# SPDX-License-Identifier: Apache-2.0
# The regression test this project offers vLLM, in the style of its
# tests/kernels/core/test_cpu_activation.py: the CPU kernels' bf16 outputs against the float32
# reference rounded to nearest even (torch's cast), bit for bit. That test's rtol of 1.6e-2
# passes a kernel that truncates; this one fails it. (Not collected by this project's suite:
# check.py runs it, on the library vLLM picks and on a truncating one forced.)
import pytest
import torch

from vllm.platforms import current_platform

NUM_TOKENS = [7, 83]
HIDDEN = [512, 2048]  # silu_and_mul's d; rms_norm is left out: its reduction's order
# differs from torch's, so its float32 result is not the reference's bit for bit


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU backend's kernels")
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("d", HIDDEN)
@torch.inference_mode()
def test_silu_and_mul_bf16_rounds_to_nearest_even(num_tokens: int, d: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(num_tokens, 2 * d, dtype=torch.bfloat16)
    out = torch.empty(num_tokens, d, dtype=torch.bfloat16)
    torch.ops._C.silu_and_mul(out, x)
    a, b = x.float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(a) * b).to(torch.bfloat16)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


@pytest.mark.skipif(not current_platform.is_cpu(), reason="the CPU backend's kernels")
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("head_size", [64, 128])
@torch.inference_mode()
def test_rotary_embedding_bf16_rounds_to_nearest_even(num_tokens: int, head_size: int) -> None:
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    heads = 4
    query = torch.randn(num_tokens, heads * head_size, dtype=torch.bfloat16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(num_tokens).float(), inv_freq)
    cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(torch.bfloat16)
    out = query.clone()
    ops.rotary_embedding(torch.arange(num_tokens), out, query.clone(), head_size, cos_sin_cache,
                         True)
    x = query.float().view(num_tokens, heads, head_size)
    cos, sin = cos_sin_cache.float()[:, None].chunk(2, -1)
    x1, x2 = x.chunk(2, -1)
    ref = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view_as(query)
    torch.testing.assert_close(out, ref.to(torch.bfloat16), atol=0, rtol=0)
