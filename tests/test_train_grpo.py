"""train_grpo.py: real RL steps in each dtype and fix on the real engine, strict-JSON rows, and the
hardening: bad input refused in one line before any work, a run never overwritten, a hard kill
and resume, a clear stop on non-finite values."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import instruments
import train_grpo
import warm_start
from conftest import INSTRUMENT_KEYS, KEYS, ROOT, rl, tiny_args
from model import load_hf, save_hf
from precision import get_precision


def test_real_rl_steps_in_each_dtype_order_their_mismatch(dtype_runs):
    _, runs = dtype_runs
    for name, rows in runs.items():
        assert [r["step"] for r in rows] == [0, 1, 2]
        for r in rows:
            for k in KEYS + INSTRUMENT_KEYS:
                assert k in r and math.isfinite(float(r[k])), (name, k)
            assert r["grad_norm"] > 0
        assert "eval_accuracy_before" in rows[0] and "eval_accuracy" in rows[2]
        # one update per batch, pi_old the trainer's own: the ratio is exactly 1, nothing clips
        assert all(r["clip_frac"] == r["actor/pg_clipfrac"] == 0.0 for r in rows)
    k3 = {name: sum(r["mismatch_k3"] for r in rows) / len(rows) for name, rows in runs.items()}
    assert k3["fp32"] * 100 <= k3["bf16"], k3
    assert k3["bf16"] > k3["fp16"] > 0, k3


def test_metrics_lines_are_strict_json(tmp_path):
    rec = {"step": 3, "grad_norm": float("inf"), "loss": float("nan"), "reward_mean": 0.5, "mismatch_logp_abs_mean": 0.0,
           "loss_scale": 1.0, "step_skipped": True, "time_step_s": 1.0}
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    train_grpo.save_step(str(tmp_path), 3, rec, model, opt, get_precision("fp16", device="cpu").grad_scaler())
    assert json.loads(open(tmp_path / "metrics.jsonl").read()) == {**rec, "grad_norm": None, "loss": None,
                                                                   "nonfinite": ["grad_norm", "loss"]}
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["step"] == 4  # the next step to take


def test_engine_behavior_logp_makes_the_ratio_pi_over_mu(engine, warm_dir, varied_reward):
    """--behavior-logp engine: pi_old is the engine's mu, so the first update's ratio pi_theta / pi_old
    is pi / mu itself: 1 to float32 precision when both sides are fp32, visibly not in bf16."""
    dev = {}
    for name, vllm_dtype in (("fp32", "float32"), ("bf16", "bfloat16")):
        out = os.path.join(warm_dir, f"engine-{name}")
        args = tiny_args(warm_dir, "--dtype", name, *rl(2), "--behavior-logp", "engine", "--algorithm", "gspo", "--out", out)
        train_grpo.train(args, llm=engine(vllm_dtype), instruments=instruments)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert all(math.isfinite(r["mismatch_k3"]) and "clip_frac_pos" in r for r in rows)
        dev[name] = rows[0]["ratio_dev_max"]
    assert dev["fp32"] < 1e-4 and dev["bf16"] > 1e-3, dev


def test_paper_recipe_and_fixes_run_end_to_end(engine, warm_dir, varied_reward):
    """Dr. GRPO with 4 mini-batches (the clip then acts), a bf16 trainer with an fp32 engine, and
    bf16 with the fp32 LM head on both sides: real steps, finite metrics."""
    for extra, llm in ((["--dr-grpo", "--minibatches", "4"], engine("bfloat16")),
                       (["--engine-dtype", "fp32"], engine("float32")),
                       (["--lm-head", "fp32"], engine("bfloat16", True))):
        out = os.path.join(warm_dir, "recipe-" + "-".join(x.strip("-") for x in extra))
        train_grpo.train(tiny_args(warm_dir, "--dtype", "bf16", *rl(2), *extra, "--out", out), llm=llm,
                         instruments=instruments)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), extra
        if "--minibatches" in extra:
            assert max(r["ratio_dev_max"] for r in rows) > 0  # later mini-batches move away from pi_old


@pytest.mark.parametrize("argv, flag", [
    (["--dtype", "fp8"], "--dtype"), (["--dtype", "float16"], "--dtype"), (["--steps", "0"], "--steps"),
    (["--lr", "abc"], "--lr"), (["--lr", "-1e-3"], "--lr"), (["--lr", "nan"], "--lr"), (["--batch-size", "x"], "--batch-size"),
    (["--group-size", "1"], "--group-size"), (["--n-embd", "120"], "--n-embd"), (["--n-layer", "-2"], "--n-layer"),
    (["--init", "/nonexistent"], "/nonexistent"), (["--resume", "--out", "/tmp/no-such-run"], "--resume"), (["--lm-head", "fp8"], "--lm-head"),
    (["--engine-dtype", "int8"], "--engine-dtype"), (["--minibatches", "100000"], "--minibatches"),
    (["--max-new-tokens", "3"], "--max-new-tokens"),  # no 24-token answer fits: every reward 0
    (["--n-items", "5000"], "positions"),  # a context far beyond the model's (minutes of silence)
    (["--dr-grpo", "--algorithm", "gspo"], "--dr-grpo"),
    (["--algorithm", "token-tis", "--behavior-logp", "engine"], "token-tis"),
    (["--trainer-kernels", "gpu"], "--trainer-kernels"), (["--trainer-kernels", "engine", "--dtype", "fp32"], "--trainer-kernels"),
    (["--trainer-kernels", "engine", "--dtype", "bf16", "--engine-dtype", "fp32"], "--trainer-kernels"),
    (["--trainer-kernels", "engine", "--dtype", "bf16", "--lm-head", "fp32"], "--trainer-kernels"),
])
def test_bad_input_is_one_line_and_exit_2(argv, flag, capsys):
    """Refused while parsing, which has no side effects: nothing is written, no engine starts."""
    with pytest.raises(SystemExit) as e:
        train_grpo.get_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and flag in err, err


def test_an_existing_run_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(SystemExit) as e:
        train_grpo.get_args(["--out", str(out)])
    assert e.value.code == 2 and "--resume" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n' and sorted(os.listdir(out)) == ["metrics.jsonl"]


def test_a_damaged_checkpoint_is_named_in_one_line_before_any_work(tmp_path, capsys):
    """train() opens the run folder first: a checkpoint that does not load is refused before a warm
    start, an engine or a write (llm=None: reaching the engine would start one)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    (out / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit) as e:
        train_grpo.train(train_grpo.get_args(["--out", str(out), "--resume"]))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and str(out / "checkpoint.pt") in err, err
    assert sorted(os.listdir(out)) == ["checkpoint.pt", "metrics.jsonl"]  # nothing written


def test_an_unwritable_out_from_the_command_line_is_one_line_and_exit_2():
    """The whole path a user takes: `python train_grpo.py`, refused in one line on stderr, no traceback."""
    r = subprocess.run([sys.executable, "train_grpo.py", "--out", "/proc/cannot/write"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert "/proc/cannot/write" in r.stderr and not r.stdout


def test_an_init_with_too_short_a_context_is_refused_in_one_line(random_ckpt, capsys):
    """A checkpoint of 128 positions cannot serve 40 items' prompt and answer (174): refused
    before any work, not when the engine meets the first long prompt."""
    with pytest.raises(SystemExit) as e:
        train_grpo.get_args(["--init", random_ckpt, "--n-items", "40", "--out", "/tmp/never"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "context" in err, err


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def without_timings(rs):
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "rollout_tokens"))} for r in rs]


DRIVER = ("import sys, task, train_grpo; sys.path.insert(0, 'tests'); from conftest import parity_reward; "
          "task.reward = parity_reward; "
          "train_grpo.train(train_grpo.get_args(sys.argv[1:]))")


def test_a_run_killed_at_a_random_moment_then_resumed_ends_as_an_uninterrupted_one(warm_dir):
    """SIGKILL (no handler can run; Ctrl-C ends a run the same way) at a random moment after the first
    checkpoint, then --resume: the resumed run really starts mid-run (it says at which step), no step
    is duplicated, and the metrics equal an uninterrupted run's in every field but the timings. Both in fresh processes, each with its own engine; the
    reward is the varied one, so every step moves the weights."""
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "ckpt-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu")
    steps = 12
    flags = ["--dtype", "fp32", "--init", init, *rl(steps)]
    whole, killed = os.path.join(warm_dir, "kill-whole"), os.path.join(warm_dir, "kill-resumed")
    subprocess.run([sys.executable, "-c", DRIVER, *flags, "--out", whole], cwd=ROOT, check=True, capture_output=True)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *flags, "--out", killed], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.isfile(os.path.join(killed, "checkpoint.pt")) and proc.poll() is None:
        time.sleep(0.01)  # step 0 is checkpointed
    time.sleep(random.uniform(0.0, 0.5))  # before, between or inside later steps' writes
    assert proc.poll() is None, "the run ended before the kill: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = subprocess.run([sys.executable, "-c", DRIVER, *flags, "--out", killed, "--resume"], cwd=ROOT, check=True,
                       capture_output=True, text=True)
    at = int(r.stdout.split("resuming ")[1].split(" at step ")[1].split()[0])
    print(f"killed, resumed at step {at}")
    assert 1 <= at < steps
    assert without_timings(rows(killed)) == without_timings(rows(whole))


def test_nonfinite_logprob_stops_the_run_naming_step_and_quantity(engine, warm_dir, tmp_path):
    args = tiny_args(warm_dir, "--dtype", "fp32", "--out", str(tmp_path / "src"))
    model = load_hf(warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens), args.n_items, 0, "cpu"))
    with torch.no_grad():
        model.norm.weight[0] = float("nan")  # poisons every logit
    save_hf(model, str(tmp_path / "poisoned"))
    args = tiny_args(warm_dir, "--dtype", "fp32", "--out", str(tmp_path / "nan"), *rl(), "--init", str(tmp_path / "poisoned"))
    with pytest.raises(SystemExit, match=r"step 0: non-finite log-prob"):
        train_grpo.train(args, llm=engine("float32"))
    assert not os.path.isfile(tmp_path / "nan" / "metrics.jsonl")  # nothing to resume: no step was taken


def test_consecutive_fp16_skips_beyond_the_limit_stop_the_run(engine, warm_dir, monkeypatch, varied_reward):
    """A real fp16 overflow: with a loss scale of 2**60 every 16-bit gradient is inf, the scaler skips
    each step and halves the scale; three skips in a row exceed MAX_SKIPS = 2 and stop the run, with
    the checkpoint after the last step on disk."""
    import precision
    monkeypatch.setattr(precision.Precision, "grad_scaler",
                        lambda self: torch.amp.GradScaler(self.device, init_scale=2.0 ** 60, enabled=True))
    monkeypatch.setattr(train_grpo, "MAX_SKIPS", 2)
    out = os.path.join(warm_dir, "skips")
    with pytest.raises(SystemExit, match=r"step 2: 3 consecutive fp16 steps skipped"):
        train_grpo.train(tiny_args(warm_dir, "--dtype", "fp16", "--out", out, *rl(10)), llm=engine("float16"))
    done = rows(out)
    assert [r["step_skipped"] for r in done] == [True, True, True]
    assert [r["loss_scale"] for r in done] == [2.0 ** 59, 2.0 ** 58, 2.0 ** 57]
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["step"] == 3
