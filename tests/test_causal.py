"""experiments/causal.py: the causal test's tables by hand on a folder of runs with hand-set
outcomes: the falls, the paired contrasts with Holm, the growth before a fall."""
import json
import os

import pytest

import causal

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
HELDOUT = {"bf16": [0.0, 0.95, 0.1], "bf16-aligned": [0.96, 0.96, 0.97], "fp16": [0.97, 0.95, 0.96]}
ARGS = {"bf16": {}, "bf16-aligned": {"trainer_kernels": "engine"}, "fp16": {"dtype": "fp16"}}


def reward_rows(fell):
    """Four steps: the mismatch 1e-4, 2e-4, 5e-4, then (a fall) the reward below 0.5."""
    rewards = [0.9, 0.9, 0.8, 0.2 if fell else 0.9]
    rest = {"pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3], "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0],
            "response_len_mean": 24.0, "entropy_mean": 0.1, "logit_rms": 3.0}  # what results.py reads
    return [{"step": s, "reward_mean": r, "mismatch_logp_abs_mean": m, **rest}
            for s, (r, m) in enumerate(zip(rewards, [1e-4, 2e-4, 5e-4, 4e-4]))]


def causal_folder(root, heldout=HELDOUT, variant_args=ARGS):
    folder = os.path.join(root, "chip")
    for v, accs in heldout.items():
        for seed, acc in enumerate(accs):
            run = os.path.join(folder, f"gspo-engine-{v}-s{seed}")
            os.makedirs(run)
            args = {"dtype": "bf16", "seed": seed, "steps": 4, "machine": MACHINE, **variant_args[v]}
            rows = reward_rows(acc < causal.FELL)
            for f, text in (("args.json", json.dumps(args)), ("heldout.json", json.dumps({"accuracy": acc})),
                            ("metrics.jsonl", "\n".join(json.dumps(r) for r in rows))):
                open(os.path.join(run, f), "w").write(text + "\n")
    return folder


def test_the_falls_the_contrasts_and_the_growth_by_hand(tmp_path, capsys):
    out = str(tmp_path / "causal.png")
    causal.main([causal_folder(str(tmp_path)), "--out", out])
    arm = json.load(open(out[:-4] + ".json"))["arms"]["gspo-engine"]
    assert [arm["variants"][v]["fell"] for v in ("bf16", "fp16", "bf16-aligned")] == [2, 0, 0]
    tests = {(t["a"], t["b"]): t for t in arm["contrasts"]}
    assert set(tests) == {("bf16-aligned", "bf16"), ("fp16", "bf16"), ("fp16", "bf16-aligned")}
    diff = [a - b for a, b in zip(HELDOUT["fp16"], HELDOUT["bf16"])]  # 0.97, 0.0, 0.86
    assert tests[("fp16", "bf16")]["mean"] == pytest.approx(sum(diff) / 3)
    assert tests[("fp16", "bf16")]["p_sign_flip"] == pytest.approx(4 / 8)  # a 0 flips to itself
    ps = sorted(t["p_sign_flip"] for t in tests.values())
    assert tests[("fp16", "bf16")]["p_holm"] == pytest.approx(min(1, max(3 * ps[0], 2 * ps[1], 0.5)))
    # the reward first below 0.5 at step 3; the largest mismatch by then 5e-4 = 5x step 0's
    assert arm["variants"]["bf16"]["growth_before_fall"] == [[3, 5.0], None, [3, 5.0]]
    assert "| bf16 | 0.3500 +- 0.3014 (3) | 2 of 3 |" in capsys.readouterr().out


def test_an_aligned_run_whose_reward_fell_has_no_growth_to_read():
    """Mismatch 0 from step 0 (the trainer on the engine's kernels): the fall's step, no ratio."""
    rows = [{**r, "mismatch_logp_abs_mean": 0.0} for r in reward_rows(fell=True)]
    assert causal.growth_before_fall(rows) == (3, None)
    assert causal.growth_before_fall(reward_rows(fell=True)) == (3, 5.0)


def test_the_amx_control_is_a_family_of_its_own(tmp_path, capsys):
    """bf16-noamx (AMX hidden, recorded in args.json) against bf16-trunc and bf16: CONTROL's two
    contrasts, Holm over those two alone; the main table's contrast Holm over its own one."""
    heldout = {"bf16": [0.95, 0.96, 0.97], "bf16-trunc": [0.1, 0.2, 0.9],
               "bf16-noamx": [0.96, 0.94, 0.97]}
    args = {"bf16": {}, "bf16-trunc": {"kernel_library": "_C_AVX512"},
            "bf16-noamx": {"kernel_library": "_C", "amx_hidden": True}}
    out = str(tmp_path / "causal.png")
    causal.main([causal_folder(str(tmp_path), heldout, args), "--out", out])
    arm = json.load(open(out[:-4] + ".json"))["arms"]["gspo-engine"]
    assert list(arm["variants"]) == ["bf16", "bf16-trunc", "bf16-noamx"]
    assert [(t["a"], t["b"], t["tests_in_table"]) for t in arm["contrasts"]] == [("bf16-trunc", "bf16", 1)]
    control = {(t["a"], t["b"]): t for t in arm["control"]}
    assert set(control) == {("bf16-trunc", "bf16-noamx"), ("bf16-noamx", "bf16")}
    ps = sorted(t["p_sign_flip"] for t in control.values())
    assert control[("bf16-trunc", "bf16-noamx")]["p_holm"] == pytest.approx(min(1, 2 * ps[0]))
    assert {t["tests_in_table"] for t in control.values()} == {2}
    assert "| bf16-trunc - bf16-noamx | 3 |" in capsys.readouterr().out


def test_an_arm_reads_its_own_variants_in_plan_rounding_alone():
    """grpo's bf16-noamx (plan sites-grpo's, landed beside plan rounding's) is not read there,
    and no control family appears; in gspo-engine, where plan rounding ran it, it is."""
    by_variant = {v: [(s, reward_rows(False), {"heldout": 0.9 + 0.01 * s + 0.001 * i})
                      for s in range(3)]
                  for i, v in enumerate(("bf16", "bf16-trunc", "bf16-noamx"))}
    grpo = causal.arm_table(by_variant, "grpo")
    assert set(grpo["variants"]) == {"bf16", "bf16-trunc"} and "control" not in grpo
    engine = causal.arm_table(by_variant, "gspo-engine")
    assert set(engine["variants"]) == {"bf16", "bf16-trunc", "bf16-noamx"}
    assert [(t["a"], t["b"]) for t in engine["control"]] == causal.CONTROL
