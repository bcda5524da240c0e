"""Bad input, numerical faults, interruption and resume: the run never dies silently, lies, or loses
what it already did."""
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import probe
import train_grpo
from conftest import tiny_args
from model import load_hf, save_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def rl(steps=4):
    """Flags for a few small real RL steps, checkpointing after every step."""
    return ["--steps", str(steps), "--batch-size", "4", "--group-size", "4", "--eval-every", "100", "--ckpt-every", "1"]


@pytest.mark.parametrize("argv, flag", [
    (["--dtype", "fp8"], "--dtype"), (["--steps", "0"], "--steps"), (["--lr", "abc"], "--lr"),
    (["--lr", "-1e-3"], "--lr"), (["--batch-size", "x"], "--batch-size"), (["--group-size", "1"], "--group-size"),
    (["--n-embd", "120"], "--n-embd"), (["--n-layer", "-2"], "--n-layer"), (["--init", "/nonexistent"], "--init"),
    (["--out", "/proc/cannot/write"], "/proc/cannot/write"), (["--resume", "--out", "/tmp/no-such-run"], "--resume"),
    (["--lr-schedule", "linear"], "--lr-schedule"), (["--json", "x.json"], "--json"),
    (["scaler", "--json", "/proc/cannot/x.json"], "/proc/cannot"), (["histogram"], "experiment"),
])
def test_bad_input_is_one_line_and_exit_2(argv, flag, capsys):
    # the probe's own flags and positional go to probe.py; everything else to train_grpo.py
    script = probe if argv[0] in ("mismatch", "scaler", "audit", "histogram") else train_grpo
    with pytest.raises(SystemExit) as e:
        script.get_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and flag in err


def test_an_existing_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(SystemExit) as e:
        train_grpo.get_args(["--out", str(out)])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_two_runs_never_share_an_output_folder(warm_dir, capsys):
    import fcntl
    out = os.path.join(warm_dir, "locked")
    os.makedirs(out)
    with open(os.path.join(out, ".lock"), "w") as held:  # another run holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit) as e:
            train_grpo.train(tiny_args(warm_dir, "--out", out, *rl()))
    assert e.value.code == 2 and "in use by another run" in capsys.readouterr().err
    assert os.listdir(out) == [".lock"]


def test_bad_input_from_the_command_line():
    r = subprocess.run([sys.executable, "train_grpo.py", "--group-size", "1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and "--group-size" in r.stderr


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_fp32_interrupted_and_resumed_run_matches_an_uninterrupted_one(engine, warm_dir, varied_reward):
    llm = engine("float32")
    whole = os.path.join(warm_dir, "resume-whole")
    train_grpo.train(tiny_args(warm_dir, "--dtype", "fp32", "--out", whole, *rl()), llm=llm)
    part = os.path.join(warm_dir, "resume-part")
    train_grpo.train(tiny_args(warm_dir, "--dtype", "fp32", "--out", part, *rl(2)), llm=llm)
    train_grpo.train(tiny_args(warm_dir, "--dtype", "fp32", "--out", part, *rl(), "--resume"), llm=llm)
    a, b = rows(whole), rows(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3]  # appended, no step duplicated
    assert all(r["grad_norm"] > 0 for r in a)  # the weights really moved, so optimizer state mattered
    for ra, rb in zip(a[2:], b[2:]):
        assert ra["reward_mean"] == rb["reward_mean"] and ra["response_len_mean"] == rb["response_len_mean"]
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6)
        assert rb["mismatch_k3"] == pytest.approx(ra["mismatch_k3"], abs=1e-9)


def test_sigterm_stops_at_a_step_boundary_with_checkpoint_and_metrics(engine, warm_dir):
    out = os.path.join(warm_dir, "sigterm")
    args = tiny_args(warm_dir, "--dtype", "fp32", "--out", out, *rl(1000))
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert train_grpo.train(args, llm=engine("float32")) is None  # stopped, not finished
    finally:
        timer.cancel()
    done = rows(out)
    assert 1 <= len(done) < 1000 and [r["step"] for r in done] == list(range(len(done)))
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["step"] == len(done)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]


def test_nonfinite_logprob_stops_the_run_naming_step_and_quantity(engine, warm_dir, tmp_path):
    args = tiny_args(warm_dir, "--dtype", "fp32", "--out", str(tmp_path / "nan"), *rl())
    ckpt, _ = train_grpo.warm_start(args, train_grpo.model_config(args), "cpu")
    model = load_hf(ckpt)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")  # poisons every logit
    save_hf(model, str(tmp_path / "poisoned"))
    args = tiny_args(warm_dir, "--dtype", "fp32", "--out", str(tmp_path / "nan"), *rl(), "--init", str(tmp_path / "poisoned"))
    with pytest.raises(SystemExit, match=r"step 0: non-finite (engine|trainer) log-prob"):
        train_grpo.train(args, llm=engine("float32"))
    assert os.path.isfile(tmp_path / "nan" / "checkpoint.pt") and os.path.isfile(tmp_path / "nan" / "metrics.jsonl")


def test_consecutive_fp16_skips_beyond_the_limit_stop_the_run(engine, warm_dir, monkeypatch, varied_reward):
    """A real fp16 overflow: with a loss scale of 2**60 every 16-bit gradient is inf, the scaler skips
    each step and halves the scale; three skips in a row exceed --max-skips 2 and stop the run."""
    import precision
    monkeypatch.setattr(precision.Precision, "grad_scaler",
                        lambda self: torch.amp.GradScaler(self.device, init_scale=2.0 ** 60, enabled=True))
    out = os.path.join(warm_dir, "skips")
    args = tiny_args(warm_dir, "--dtype", "fp16", "--out", out, *rl(10), "--max-skips", "2")
    with pytest.raises(SystemExit, match=r"step 3: 3 consecutive fp16 steps skipped"):
        train_grpo.train(args, llm=engine("float16"))
    done = rows(out)
    assert [r["step_skipped"] for r in done] == [True, True, True]
    assert [r["loss_scale"] for r in done] == [2.0 ** 59, 2.0 ** 58, 2.0 ** 57]
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["step"] == 3
