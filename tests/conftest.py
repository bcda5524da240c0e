"""Shared fixtures: one real vLLM engine per (dtype, LM head) for the whole test session, a small warm
start in a temporary cache, and one small random checkpoint. Tests that compare the engine with the
trainer sync the weights they compare against into the engine first, so test order never matters."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "experiments")]  # the core, and the experiments' modules

import instruments  # noqa: E402
import rollout  # noqa: E402  (sets the vLLM environment variables before vllm is imported)
import task  # noqa: E402
import train_grpo  # noqa: E402
import warm_start  # noqa: E402
from model import GPT, GPTConfig, save_hf  # noqa: E402

MAX_LEN = 128
# Eight sorting prompts, for the tests that sample from an engine.
PROMPTS = [task.prompt_ids(f"sort {','.join(str((i * 7 + j) % 10) for j in range(12))}=") for i in range(8)]


@pytest.fixture(scope="session", autouse=True)
def small_warm_start(tmp_path_factory):
    """A warm start of 40 steps of 32 problems (it solves nothing, fast) and 32 held-out problems."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warm_start, "SFT_STEPS", 40)
        mp.setattr(warm_start, "SFT_BATCH", 32)
        mp.setattr(task, "N_EVAL", 32)
        mp.setattr(warm_start, "WARMSTART_DIR", str(tmp_path_factory.mktemp("warmstart")))
        yield


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
    """engine("float32" | "float16" | "bfloat16", head_fp32=False) -> the session's one vLLM engine of that kind."""
    engines = {}

    def get(vllm_dtype, head_fp32=False):
        if (vllm_dtype, head_fp32) not in engines:
            engines[vllm_dtype, head_fp32] = rollout.start_engine(random_ckpt, vllm_dtype, 0, MAX_LEN, head_fp32)
        return engines[vllm_dtype, head_fp32]
    return get


def tiny_args(tmp, *extra):
    """train_grpo arguments for a small, fast run of the real pipeline (a later --out wins)."""
    return train_grpo.get_args(["--out", os.path.join(tmp, "run"), *extra])


def rl(steps=4):
    """Flags for a few small real RL steps."""
    return ["--steps", str(steps), "--batch-size", "4", "--group-size", "4"]


@pytest.fixture(scope="session")
def warm_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def varied_reward(monkeypatch):
    """The tiny warm start solves nothing, so every reward, advantage and gradient would be 0 and no
    weight would move. Reward the parity of the first sampled token instead: it varies within a
    group, so the RL steps really update the model (and its optimizer state)."""
    monkeypatch.setattr(task, "reward", parity_reward)


def parity_reward(ids, answer):
    """1 when the first sampled token is even: varies within a group whatever the model knows."""
    return float(bool(ids) and ids[0] % 2 == 0)


KEYS = ["step", "reward_mean", "response_len_mean", "mismatch_k1", "mismatch_k3", "mismatch_prob_abs_max",
        "mismatch_prob_abs_mean", "mismatch_logp_abs_mean", "grad_norm", "loss_scale", "step_skipped",
        "time_rollout_s", "time_logprob_s", "time_train_s", "time_sync_s", "logp_mean", "clip_frac",
        "actor/pg_clipfrac", "clip_ratio/region_mean"]
INSTRUMENT_KEYS = ["resid_rms", "hidden_rms", "logit_rms", "logit_abs_max", "entropy_mean", "weight_rms",
                   "clip_frac_pos", "clip_frac_neg", "clip_seq_frac", "ratio_dev_max"]


@pytest.fixture(scope="session")
def dtype_runs(engine, warm_dir):
    """Three real runs of three steps, one per dtype, with the experiments' instruments on (as
    campaign.py runs them): {dtype: rows}, in one folder for campaign_figure.py."""
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
