"""model.py against an independent implementation (transformers' LlamaForCausalLM) and itself."""
import pytest
import torch

import rollout
import task
from model import GPT, GPTConfig, hf_named_tensors, load_hf, save_hf, token_logprobs
from precision import TensorCoreMatmuls, autocast, get_precision
from conftest import PROMPTS
from model import pack

NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def test_matches_transformers_in_fp32(random_ckpt):
    from transformers import LlamaForCausalLM
    ours = load_hf(random_ckpt).eval()
    ref = LlamaForCausalLM.from_pretrained(random_ckpt, dtype=torch.float32).eval()
    idx = torch.randint(0, task.VOCAB_SIZE, (8, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = token_logprobs(ours, idx)
        logits = ref(idx[:, :-1]).logits.float()
        b = torch.gather(torch.log_softmax(logits, -1), -1, idx[:, 1:, None]).squeeze(-1)
    assert (a - b).abs().max().item() <= 1e-5


def test_export_load_roundtrip_is_identical(tmp_path):
    torch.manual_seed(3)
    m = GPT(GPTConfig(n_layer=2))
    save_hf(m, str(tmp_path))
    m2 = load_hf(str(tmp_path))
    assert m2.cfg == m.cfg
    for (k, v), (k2, v2) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_refuses_head_size_vllm_cannot_serve():
    with pytest.raises(ValueError, match="head size"):
        GPTConfig(n_embd=120, n_head=4)  # head 30


def test_load_refuses_a_folder_that_is_not_ours(tmp_path):
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not a checkpoint written by model.py"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_emulated_autocast_has_the_error_size_of_real_autocast(random_ckpt, dtype):
    """The CPU emulation of 16-bit matmuls is a model of autocast's rounding, not a bit-exact copy
    (attention internals differ): its distance to float32 must be the size of real autocast's."""
    m = load_hf(random_ckpt).eval()
    idx = torch.randint(0, task.VOCAB_SIZE, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = token_logprobs(m, idx)
        with torch.autocast("cpu", dtype=dtype):
            real = (token_logprobs(m, idx) - exact).abs().mean().item()
        with autocast(NAME[dtype], "cpu"):
            emul = (token_logprobs(m, idx) - exact).abs().mean().item()
    assert real > 0 and emul > 0
    assert 1 / 3 < emul / real < 3, (emul, real)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_trainer_is_closer_to_a_wholly_16bit_llama_than_autocast_is(random_ckpt, engine, name):
    """transformers' LlamaForCausalLM loaded in the dtype runs every activation in 16 bits, natively:
    the trainer's 16-bit module (Precision.forward) must be closer to it than the old autocast mode,
    in mean |delta log p| on tokens the engine sampled."""
    from transformers import LlamaForCausalLM
    prec = get_precision(name, device="cpu")
    m = load_hf(random_ckpt).eval()
    llm = engine("float32")
    rollout.sync_weights(llm, hf_named_tensors(m), torch.float32)
    torch.manual_seed(0)
    samples = rollout.generate(llm, PROMPTS, 4, 32, task.EOS_ID)
    idx, mask, _ = pack([s.prompt_ids for s in samples], [s.response_ids for s in samples], "cpu")
    ref = LlamaForCausalLM.from_pretrained(random_ckpt, dtype=prec.dtype).eval()
    with torch.no_grad():
        hf = token_logprobs(lambda x: ref(x).logits, idx)
        full = ((token_logprobs(prec.logits_fn(m), idx) - hf).abs() * mask).sum() / mask.sum()
        with autocast(name, "cpu"):
            auto = ((token_logprobs(m, idx) - hf).abs() * mask).sum() / mask.sum()
    assert full < auto, (full.item(), auto.item())


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_16bit_trainer_keeps_every_activation_in_16_bits(random_ckpt, name):
    """Embedding output, residual stream, attention, MLP and logits in the dtype; a float32 promotion
    inside the 16-bit forward is refused on a CPU rather than silently computed in float32."""
    prec = get_precision(name, device="cpu")
    m = load_hf(random_ckpt).eval()
    seen = {}
    for mod_name, mod in m.named_modules():
        if mod_name:
            mod.register_forward_hook(lambda mod, inp, out, mod_name=mod_name: seen.update({mod_name: out.dtype}))
    idx = torch.randint(0, task.VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = prec.logits_fn(m)(idx)
    assert logits.dtype == prec.dtype and set(seen.values()) == {prec.dtype}, seen
    assert {"embed_tokens", "layers.0.self_attn", "layers.0.mlp", "layers.3", "norm"} <= set(seen)
    with pytest.raises(RuntimeError, match="float32"):
        with TensorCoreMatmuls(prec.dtype, strict=True):
            torch.ones(2, dtype=prec.dtype) * torch.ones(2)  # a float32 tensor would promote the activation


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_fp32_head_is_the_cast_path_vllm_runs(random_ckpt, name):
    """--lm-head fp32: the 16-bit hidden states and the head weight rounded to the dtype, both cast to
    float32, multiplied there: float32 logits, equal to that product computed by hand."""
    prec = get_precision(name, lm_head="fp32", device="cpu")
    m = load_hf(random_ckpt).eval()
    idx = torch.randint(0, task.VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden = {}
    m.norm.register_forward_hook(lambda mod, inp, out: hidden.update(h=out))
    with torch.no_grad():
        logits = prec.logits_fn(m)(idx)
    by_hand = hidden["h"].float() @ m.lm_head.weight.to(prec.dtype).float().T
    assert logits.dtype == torch.float32 and hidden["h"].dtype == prec.dtype
    assert torch.allclose(logits, by_hand, rtol=1e-6, atol=1e-6)
    assert not torch.equal(logits, by_hand.to(prec.dtype).float())  # not rounded to 16 bits afterwards
