"""model.py against an independent implementation (transformers' LlamaForCausalLM) and itself."""
import pytest
import torch

import task
from model import GPT, GPTConfig, load_hf, save_hf, token_logprobs
from precision import Emulated16BitMatmuls


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
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(n_layer=0)


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
        with Emulated16BitMatmuls(dtype):
            emul = (token_logprobs(m, idx) - exact).abs().mean().item()
    assert real > 0 and emul > 0
    assert 1 / 3 < emul / real < 3, (emul, real)
