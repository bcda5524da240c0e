"""experiments/meter.py: on this project's export its numbers are the anatomy's on the same tokens;
on a model of another architecture (a random Qwen2, its tokenizer made here) it measures what it
says; with the truncating library forced its verdict changes; it refuses bad input in one line."""
import json
import os
import subprocess
import sys

import pytest
import torch

import anatomy
import meter
import random_model
import warm_start
from instruments import machine
from model import logprobs_of

HERE = os.path.dirname(os.path.abspath(__file__))
METER = os.path.join(os.path.dirname(HERE), "experiments", "meter.py")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return random_model.make(str(tmp_path_factory.mktemp("qwen2")))


@pytest.fixture(scope="module")
def qwen_result(qwen, tmp_path_factory):
    """The meter on the random Qwen2, in bf16, with this process's library (the chip's own)."""
    out = str(tmp_path_factory.mktemp("meter") / "meter.json")
    meter.main([qwen, "--samples", "2", "--max-new-tokens", "16", "--json", out])
    return json.load(open(out))


def test_on_this_projects_export_the_meter_is_the_anatomy(engine):
    """The warm start's export, this project's trainer, anatomy's sampling: the same tokens (their
    digest) and every figure the two share equal, bf16 and fp16."""
    ckpt = warm_start.warm_start(warm_start.model_config(12, 32), 12, 0, "cpu")
    a = anatomy.main(["--group-size", "2"], engine)
    for dtype in ("bf16", "fp16"):
        m = meter.main([ckpt, "--dtype", dtype, "--prompts", "sorting", "--trainer", "project",
                        "--samples", "2", "--max-new-tokens", "32", "--chunk", "100000"], engine)
        ours = a["variants"][dtype]
        assert m["tokens_sha1"] == a["tokens_sha1"] and m["tokens"] == a["tokens"]
        for key in ("logp_abs_mean", "signed_mean", "by_pi", "tau", "lag1_correlation"):
            assert m[key] == ours[key], key
        shared = {k: m["window"][k] for k in ours["gspo_window"]}
        assert shared == ours["gspo_window"]


def test_on_a_qwen2_it_measures_what_it_says(qwen, qwen_result):
    """Another architecture: the sampled tokens scored by both sides, TRL's mean |log-ratio| the
    meter's own mean |d| (two computations, one quantity), NeMo RL's k3 verl's, a row per layer
    (embeddings, 2 layers, the logits), the trainer's error growing from the embeddings on, and
    the result strict JSON."""
    r = qwen_result
    assert r["architecture"] == ["Qwen2ForCausalLM"] and r["sequences"] == 12 * 2
    assert 0 < r["logp_abs_mean"] < 0.1
    trl = r["dashboards"]["trl"]["sampling/sampling_logp_difference/mean"]
    assert trl == pytest.approx(r["logp_abs_mean"], rel=1e-4)
    k3 = r["dashboards"]["verl"]["rollout_corr/k3_kl"]
    assert r["dashboards"]["nemo_rl"]["train/gen_kl_error"] == pytest.approx(k3, rel=1e-3)
    names = ["embeddings", "layer 1", "layer 2 + norm", "logits"]
    assert [x["layer"] for x in r["layers"]] == names
    errors = [x["rel_error"] for x in r["layers"]]
    assert 0 < errors[0] < errors[1]
    assert sum(b["tokens"] for b in r["by_pi"]) == r["tokens"]


def test_the_trainer_side_is_transformers_in_the_dtype(qwen):
    """meter.hf_trainer's low forward is transformers' bf16 model: its log-probs differ from the
    float32 model's by bf16's size, not 0 and not more."""
    forward = meter.hf_trainer(qwen, "bf16")
    idx = torch.randint(0, random_model.VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        low, ref = (logprobs_of(forward(idx[:, :-1], k)[0], idx) for k in (True, False))
    assert 1e-4 < (low - ref).abs().mean().item() < 5e-2


@pytest.mark.skipif("avx512_bf16" not in machine()["cpu_isa"],
                    reason="needs a chip whose own vLLM library rounds")
def test_the_truncating_library_changes_the_verdict(qwen, qwen_result, tmp_path):
    """The chip's own library does not truncate; _C_AVX512 forced (a process of its own: one
    library a process) truncates at the rotary and the attention, and the verdict says so."""
    assert "does not truncate" in qwen_result["verdict"]
    out = str(tmp_path / "trunc.json")
    subprocess.run([sys.executable, METER, qwen, "--library", "_C_AVX512", "--samples", "2",
                    "--max-new-tokens", "16", "--json", out], check=True, capture_output=True)
    r = json.load(open(out))
    assert r["engine_rounding"]["library"] == "_C_AVX512"
    assert "truncates float32 to bf16 at rotary_embedding, attention" in r["verdict"]
    assert r["tokens_sha1"] == qwen_result["tokens_sha1"]  # the float32 engine's: the same tokens


def test_it_refuses_in_one_line_before_any_work(qwen, tmp_path, capsys):
    """Not a model, an architecture neither loads, a prompt file that is not JSON lines or has no
    prompt, prompts past the context, a clip that is not a window: exit 2, one line, nothing
    written."""
    nope = tmp_path / "nope"
    nope.mkdir()
    (nope / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_ids": [1] * 250}) + "\n")
    bad, none = tmp_path / "bad.jsonl", tmp_path / "none.jsonl"
    bad.write_text("{not json\n")
    none.write_text(json.dumps({"text": "a"}) + "\n")
    out = str(tmp_path / "out.json")
    cases = [([str(tmp_path)], "not a Hugging Face model folder"),
             ([qwen, "--prompts", str(bad)], "not JSON lines"),
             ([qwen, "--prompts", str(none)], "no prompt(_ids)"),
             ([str(nope)], "cannot load architecture NoSuchForCausalLM"),
             ([qwen, "--prompts", str(long)], "exceed the model's context, 256"),
             ([qwen, "--clip", "0.2", "1.5"], "--clip"),
             ([qwen, "--clip", "0", "0.2"], "--clip")]
    for argv, says in cases:
        with pytest.raises(SystemExit) as e:
            meter.main([*argv, "--json", out])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and says in err[0], (argv, err)
    assert not os.path.exists(out)


def test_it_refuses_a_dtype_the_engine_cannot_run(qwen, monkeypatch):
    """A dtype vLLM's platform does not list (here one made to list float32 alone): exit 2."""
    from vllm.platforms import current_platform
    only_fp32 = property(lambda self: [torch.float32])
    monkeypatch.setattr(type(current_platform), "supported_dtypes", only_fp32)
    with pytest.raises(SystemExit) as e:
        meter.main([qwen, "--dtype", "fp16"])
    assert e.value.code == 2
