"""Shared fixtures: one real vLLM engine per dtype for the whole test session, and one small
warm-started checkpoint. Tests that compare the engine with the trainer sync the weights they
compare against into the engine first, so test order never matters."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rollout  # noqa: E402  (sets the vLLM environment variables before vllm is imported)
import task  # noqa: E402
from model import GPT, GPTConfig, save_hf  # noqa: E402

MAX_LEN = 128


@pytest.fixture(scope="session")
def random_ckpt(tmp_path_factory):
    """The default-size model with random weights, exported."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, max_seq_len=MAX_LEN))
    path = str(tmp_path_factory.mktemp("random_ckpt"))
    save_hf(model, path)
    return path


@pytest.fixture(scope="session")
def engine(random_ckpt):
    """engine("float32" | "float16" | "bfloat16") -> the session's one vLLM engine of that dtype."""
    engines = {}

    def get(vllm_dtype):
        if vllm_dtype not in engines:
            engines[vllm_dtype] = rollout.start_engine(random_ckpt, vllm_dtype, seed=0, max_model_len=MAX_LEN)
        return engines[vllm_dtype]
    return get


def tiny_args(tmp, *extra):
    """train_grpo arguments for a small, fast run of the real pipeline."""
    import train_grpo
    return train_grpo.get_args(["--sft-steps", "40", "--sft-batch", "32", "--n-eval", "32",
                                "--warmstart-dir", os.path.join(tmp, "warmstart"),
                                "--out", os.path.join(tmp, "run"), *extra])  # a later --out wins


@pytest.fixture(scope="session")
def warm_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def varied_reward(monkeypatch):
    """The tiny warm start of these tests solves nothing, so every reward, advantage and gradient
    would be 0 and no weight would move. Reward the parity of the first sampled token instead: it
    varies within a group, so the RL steps really update the model (and its optimizer state)."""
    import train_grpo
    monkeypatch.setattr(train_grpo.task, "reward", lambda ids, answer: float(bool(ids) and ids[0] % 2 == 0))
