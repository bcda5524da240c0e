"""The trainer on the engine's kernels (aligned.py): its log-probs equal the real engine's bit for
bit, and each hand-written backward equals autograd of the plain op on the same inputs."""
import pytest
import torch
import torch.nn.functional as F

import aligned
import instruments
import rollout
import task
from conftest import PROMPTS
from model import GPTConfig, hf_named_tensors, load_hf, pack, token_logprobs
from precision import get_precision

DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_aligned_logprobs_equal_the_engines(engine, random_ckpt, name):
    """On the engine's samples, the aligned trainer's log-probs equal the engine's, as it sampled them
    (decode) and as it scores them (prefill, prompt_logprobs): every token in fp16 (torch's GEMM, batch-
    invariant here); in bf16 all but the few the engine itself computed in a batch whose size makes
    oneDNN's GEMM round otherwise (docs: experiments/aligned.md), each of those within the
    emulated trainer's mismatch. The emulated trainer is off everywhere."""
    model, aligned_prec, plain_prec = load_hf(random_ckpt), get_precision(name, kernels="engine"), get_precision(name)
    llm = engine(aligned_prec.vllm_dtype)
    rollout.sync_weights(llm, hf_named_tensors(model), aligned_prec.dtype)
    torch.manual_seed(0)
    samples = rollout.generate(llm, PROMPTS, 4, 32, task.EOS_ID)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    scored = instruments.prefill_logprobs(llm, [p + r for p, r in zip(prompts, responses)], [len(p) for p in prompts])
    idx, mask, decode = pack(prompts, responses, "cpu", [s.logprobs for s in samples])
    prefill, on = pack(prompts, responses, "cpu", scored)[2], mask.bool()
    with torch.no_grad():
        aligned_lp, plain_lp = (token_logprobs(p.logits_fn(model), idx)[on] for p in (aligned_prec, plain_prec))
    assert on.sum() > 8 * 4 * 10
    plain_gap = (plain_lp - prefill[on]).abs()
    assert (plain_gap > 0).float().mean() > 0.5  # the emulated trainer's mismatch: most tokens
    for engine_lp in (decode[on], prefill[on]):
        off = aligned_lp != engine_lp
        assert off.float().mean() <= (0 if name == "fp16" else 0.01), off.sum()
        assert (aligned_lp - engine_lp).abs().max() <= plain_gap.max()


def grads(f, inputs, g):
    """d(sum(f(inputs) * g)) / d(inputs), by autograd through f."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = f(*inputs)
    torch.autograd.backward(out, g)
    return [t.grad for t in inputs]


def close(ours, reference, dtype):
    """Equal but for the rounding of the result to `dtype`: within 2 units of its epsilon at the largest entry."""
    eps = torch.finfo(dtype).eps
    return (ours.float() - reference.float()).abs().max().item() <= 2 * eps * reference.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_is_autograds(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(37, 128).to(dtype), torch.randn(96, 128).to(dtype)
    g = torch.randn(37, 96).to(dtype)
    ours = grads(aligned.Linear.apply, [x, w], g)
    # Autograd of the product in float32 of the same 16-bit numbers, rounded as ours are.
    reference = grads(lambda a, b: F.linear(a.float(), b.float()), [x, w], g.float())
    for a, b in zip(ours, reference):
        assert a.dtype == dtype and torch.equal(a, b.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_backward_is_autograds(dtype):
    torch.manual_seed(0)
    cfg, T, heads, head = GPTConfig(), 50, 4, 32
    table, pos = aligned.rope_table(cfg, dtype), torch.arange(T)
    q, k, gq, gk = (torch.randn(T, heads * head).to(dtype) for _ in range(4))
    ours = grads(lambda a, b: aligned.Rope.apply(a, b, pos, table, head), [q, k], [gq, gk])
    cos, sin = (c.repeat(1, 2).repeat(1, heads) for c in table[pos].float().chunk(2, dim=-1))

    def plain(a, b):  # "rotate half" in float32, per head, with the same 16-bit table
        def rotate(x):
            x1, x2 = x.view(T, heads, head).chunk(2, dim=-1)
            return torch.cat([-x2, x1], dim=-1).view(T, -1)
        return a.float() * cos + rotate(a.float()) * sin, b.float() * cos + rotate(b.float()) * sin
    reference = grads(plain, [q, k], [gq.float(), gk.float()])
    for a, b in zip(ours, reference):
        assert a.dtype == dtype and close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_backward_is_autograds(dtype):
    torch.manual_seed(0)
    B, T, heads, head = 3, 45, 4, 32
    q, k, v, g = (torch.randn(B * T, heads, head).to(dtype) for _ in range(4))
    ours = grads(lambda a, b, c: aligned.Attention.apply(a, b, c, B, T), [q, k, v], g)

    def plain(a, b, c):  # causal attention in float32 on the same 16-bit numbers
        a, b, c = (t.float().view(B, T, heads, head).transpose(1, 2) for t in (a, b, c))
        return F.scaled_dot_product_attention(a, b, c, is_causal=True).transpose(1, 2).reshape(B * T, heads, head)
    reference = grads(plain, [q, k, v], g.float())
    for a, b in zip(ours, reference):
        assert a.dtype == dtype and close(a, b, dtype)
    # ... and the forward is the same function (the engine's kernel rounds to 16 bits)
    assert close(aligned.Attention.apply(q, k, v, B, T), plain(q, k, v), dtype)


def test_aligned_trainer_gets_gradients_in_every_master_weight(random_ckpt):
    model = load_hf(random_ckpt)
    idx = torch.randint(0, 256, (4, 20))
    logits = get_precision("bf16", kernels="engine").logits_fn(model)(idx)
    assert logits.dtype == torch.bfloat16 and logits.shape == (4, 20, model.cfg.vocab_size)
    logits.float().logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0, name
