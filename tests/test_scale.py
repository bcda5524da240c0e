"""experiments/scale.py: the scale table by hand on hand-set runs of both arms (falls, step-0
sizes, the contrasts paired by seed, Holm over each arm's own), and the warm starts' table from
hand-set held-out readings (the larger must reach the smaller's)."""
import json
import os
import shutil

import pytest

import scale

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["amx_tile"], "torch": "t", "vllm": "v", "host": "h"}
RECORDS = {"bf16-noamx": {"kernel_library": "_C", "amx_hidden": True},
           "bf16-trunc": {"kernel_library": "_C_AVX512"},
           "bf16-trunc-site-trunc": {"kernel_library": "_C_AVX512", "site_rounding": "trunc"},
           "bf16-aligned": {"trainer_kernels": "engine"},  # relabel's targets below
           "bf16-site-trunc": {"site_rounding": "trunc"}, "bf16-site-rne5": {"site_rounding": "rne5"},
           "bf16-trunc-site-truncpm2": {"kernel_library": "_C_AVX512",
                                        "site_rounding": "truncpm2"},
           "bf16-trunc-site-sym": {"kernel_library": "_C_AVX512", "site_rounding": "sym"}}
HELDOUT = {"gspo-engine": {"bf16-noamx": [0.95, 0.96, 0.94], "bf16-trunc": [0.2, 0.9, 0.3],
                           "bf16-trunc-site-trunc": [0.96, 0.95, 0.95]},
           "gspo-engine-x8": {"bf16-noamx": [0.97, 0.96, 0.98], "bf16-trunc": [0.96, 0.1, 0.97]}}


def rows(seed, acc, m0=1e-4):
    rest = {"pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3], "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0],
            "response_len_mean": 24.0, "entropy_mean": 0.1, "logit_rms": 3.0}  # what results.py reads
    return [{"step": s, "reward_mean": 0.3 if acc < 0.5 and s >= 2 else 0.9,
             "mismatch_logp_abs_mean": m0 * (1 + seed) * (1 + s), "mismatch_k1": -m0 / 10, **rest}
            for s in range(3)]


def write_metrics(run, seed, acc, m0=1e-4):
    open(os.path.join(run, "metrics.jsonl"), "w").write(
        "\n".join(json.dumps(r) for r in rows(seed, acc, m0)) + "\n")


def folder(root):
    for arm, cells in HELDOUT.items():
        for v, accs in cells.items():
            for seed, acc in enumerate(accs):
                run = os.path.join(root, f"{arm}-{v}-s{seed}")
                os.makedirs(run)
                args = {"dtype": "bf16", **RECORDS[v], "seed": seed, "steps": 3, "machine": MACHINE}
                json.dump(args, open(os.path.join(run, "args.json"), "w"))
                json.dump({"accuracy": acc}, open(os.path.join(run, "heldout.json"), "w"))
                write_metrics(run, seed, acc)
    return root


def relabel(root, before, after, dtype="bf16", m0=None):
    """folder's runs of variant BEFORE made AFTER's: BEFORE's record dropped from args.json, the
    dtype and AFTER's record (RECORDS, where it has one) set, and where m0 is given the metrics
    set again at that step-0 scale."""
    for arm, cells in HELDOUT.items():
        for seed, acc in enumerate(cells.get(before, [])):
            run = os.path.join(root, f"{arm}-{before}-s{seed}")
            args = json.load(open(os.path.join(run, "args.json")))
            kept = {k: v for k, v in args.items() if k not in RECORDS[before]}
            json.dump(kept | {"dtype": dtype, **RECORDS.get(after, {})},
                      open(os.path.join(run, "args.json"), "w"))
            if m0:
                write_metrics(run, seed, acc, m0)
            os.rename(run, os.path.join(root, f"{arm}-{after}-s{seed}"))
    return root


def test_the_table_by_hand_each_arm_its_own_family(tmp_path, capsys):
    out = scale.read(folder(str(tmp_path)), None)
    small, large = out["arms"]["gspo-engine"], out["arms"]["gspo-engine-x8"]
    assert list(small["variants"]) == ["bf16-trunc", "bf16-noamx", "bf16-trunc-site-trunc"]  # the plan's order
    assert large["variants"]["bf16-trunc"]["fell"] == 1 and small["variants"]["bf16-trunc"]["fell"] == 2
    assert large["variants"]["bf16-trunc"]["step0_abs"] == pytest.approx([1e-4, 2e-4, 3e-4])
    pairs = {(t["a"], t["b"]): t for t in small["contrasts"]}
    assert set(pairs) == {("bf16-trunc", "bf16-noamx"), ("bf16-trunc-site-trunc", "bf16-trunc")}
    fix = pairs[("bf16-trunc-site-trunc", "bf16-trunc")]  # +0.76, +0.05, +0.65
    assert fix["mean"] == pytest.approx(1.46 / 3) and fix["p_sign_flip"] == 0.25
    assert fix["tests_in_table"] == 2 and fix["p_holm"] == pytest.approx(0.5)
    (only,) = large["contrasts"]  # one test: Holm leaves its p as it is
    assert (only["a"], only["b"], only["tests_in_table"]) == ("bf16-trunc", "bf16-noamx", 1)
    assert only["p_holm"] == only["p_sign_flip"] and only["mean"] == pytest.approx(-0.88 / 3)
    scale.print_read(out)
    printed = capsys.readouterr().out
    assert "| bf16-trunc | 2.000e-04 | -1.00e-05 | 1 of 3 | 0.6767 +- 0.2883 (3) |" in printed
    ratios = small["step0_ratios"]  # every run's step 0 is 1e-4 x (1 + seed): a ratio of 1 by seed
    assert ratios["bf16-trunc / bf16-noamx"]["mean"] == pytest.approx(1.0)
    assert "bf16-trunc / bf16-noamx, seed by seed: mean 1.00x, 1.00x to 1.00x (n = 3)" in printed


def test_a_seed_whose_larger_warm_start_fell_short_is_left_out_and_unread_seeds_are_named(tmp_path, capsys):
    root = folder(str(tmp_path))
    os.makedirs(os.path.join(root, "scale"))
    for arm, seed, acc in (("gspo-engine", 0, 0.92), ("gspo-engine-x8", 0, 0.93),
                           ("gspo-engine", 1, 0.92), ("gspo-engine-x8", 1, 0.91)):  # seed 1 short
        json.dump({"accuracy": acc}, open(os.path.join(root, "scale", f"warmstart-{arm}-s{seed}.json"), "w"))
    out = scale.read(root, None)
    assert out["warm_start_reaches"] == {0: True, 1: False, 2: None}
    large = out["arms"]["gspo-engine-x8"]["variants"]
    assert large["bf16-trunc"]["seeds"] == [0, 2] and large["bf16-trunc"]["fell"] == 0  # seed 1's fall out
    assert out["arms"]["gspo-engine"]["variants"]["bf16-trunc"]["seeds"] == [0, 1, 2]  # the smaller: all
    scale.print_read(out)
    assert "reached the smaller's: seeds [0]; fell short, left out: [1]; not read: [2]" in capsys.readouterr().out


def test_the_smaller_arm_reads_alone_and_a_folder_without_the_plans_variants_is_refused(tmp_path):
    root = folder(str(tmp_path))
    for name in os.listdir(root):
        if name.startswith("gspo-engine-x8-"):
            shutil.rmtree(os.path.join(root, name))
    assert list(scale.read(root, None)["arms"]) == ["gspo-engine"]  # the prediction's numbers
    for name in os.listdir(root):  # one run left, of a variant not in plan scale (bf16)
        if name != "gspo-engine-bf16-noamx-s0":
            shutil.rmtree(os.path.join(root, name))
    args = json.load(open(os.path.join(root, "gspo-engine-bf16-noamx-s0", "args.json")))
    json.dump({k: v for k, v in args.items() if k not in RECORDS["bf16-noamx"]},
              open(os.path.join(root, "gspo-engine-bf16-noamx-s0", "args.json"), "w"))
    os.rename(os.path.join(root, "gspo-engine-bf16-noamx-s0"), os.path.join(root, "gspo-engine-bf16-s0"))
    with pytest.raises(SystemExit) as e:
        scale.read(root, None)
    assert e.value.code == 2


def test_the_warm_starts_table_reads_its_readings_and_says_whether_the_larger_reaches(tmp_path, monkeypatch):
    """A reading of the arm's own warm start is kept; one of another checkpoint (an earlier recipe's)
    is measured again, by heldout.py in a process of its own."""
    os.makedirs(tmp_path / "scale")
    for arm, acc in (("gspo-engine", 0.92), ("gspo-engine-x8", 0.90)):  # seed 0's larger falls short
        json.dump({"checkpoint": f"runs/warmstart/{arm}", "accuracy": acc, "se": 0.01},
                  open(tmp_path / "scale" / f"warmstart-{arm}-s0.json", "w"))
    monkeypatch.setattr(scale, "warm_start_of", lambda arm, seed: (f"runs/warmstart/{arm}", 10))
    calls = []
    monkeypatch.setattr(scale.subprocess, "run", lambda cmd, check: calls.append(cmd))
    out = scale.warm_starts(str(tmp_path), [0])  # both readings are of these checkpoints
    assert calls == [] and out["s0"]["reaches"] is False
    assert out["s0"]["larger_minus_smaller"] == pytest.approx(-0.02)
    assert out["s0"]["gspo-engine-x8"]["checkpoint"] == "runs/warmstart/gspo-engine-x8"

    def heldout(cmd, check):  # what heldout.py would write for the new checkpoint
        calls.append(cmd)
        json.dump({"checkpoint": cmd[cmd.index("--init") + 1], "accuracy": 0.95, "se": 0.01},
                  open(cmd[cmd.index("--json") + 1], "w"))
    monkeypatch.setattr(scale.subprocess, "run", heldout)
    monkeypatch.setattr(scale, "warm_start_of", lambda arm, seed: (f"runs/warmstart/{arm}-new", 10))
    out = scale.warm_starts(str(tmp_path), [0])
    assert len(calls) == 2 and out["s0"]["reaches"] is True
    assert calls[1][calls[1].index("--init") + 1] == "runs/warmstart/gspo-engine-x8-new"


def test_plan_scale_own_reads_the_chips_own_library_as_the_rounding_control(tmp_path):
    """Without AMX to hide, bf16 (the chip's own rounding library) takes bf16-noamx's place in
    the contrasts and the step-0 ratios; plan scale on the same folder reads no bf16 cell."""
    root = relabel(folder(str(tmp_path)), "bf16-noamx", "bf16")
    small = scale.read(root, None, "scale-own")["arms"]["gspo-engine"]
    assert list(small["variants"]) == ["bf16-trunc", "bf16", "bf16-trunc-site-trunc"]
    pairs = {(t["a"], t["b"]): t for t in small["contrasts"]}
    assert set(pairs) == {("bf16-trunc", "bf16"), ("bf16-trunc-site-trunc", "bf16-trunc")}
    assert pairs[("bf16-trunc", "bf16")]["mean"] == pytest.approx((-0.75 - 0.06 - 0.64) / 3)
    assert list(small["step0_ratios"]) == ["bf16-trunc / bf16", "bf16-trunc-site-trunc / bf16"]
    as_amx = scale.read(root, None)["arms"]["gspo-engine"]
    assert "bf16" not in as_amx["variants"] and len(as_amx["contrasts"]) == 1


def test_plan_scale_fp16_reads_fp16_against_bf16_alone(tmp_path):
    """Plan scale-fp16's one contrast, fp16 - bf16, by hand, and its step-0 ratio (fp16's runs
    set at a tenth of bf16's mismatch, seed by seed); the plan's variants alone are read."""
    root = relabel(folder(str(tmp_path)), "bf16-noamx", "bf16")
    relabel(root, "bf16-trunc", "fp16", dtype="fp16", m0=1e-5)
    small = scale.read(root, None, "scale-fp16")["arms"]["gspo-engine"]
    assert list(small["variants"]) == ["bf16", "fp16"]  # bf16-trunc-site-trunc is not the plan's
    (only,) = small["contrasts"]
    assert (only["a"], only["b"]) == ("fp16", "bf16")
    assert only["mean"] == pytest.approx((-0.75 - 0.06 - 0.64) / 3)
    assert only["p_holm"] == only["p_sign_flip"]  # one test: Holm leaves it as it is
    ratio = small["step0_ratios"]["fp16 / bf16"]
    assert ratio["mean"] == pytest.approx(0.1) and ratio["range"] == pytest.approx([0.1, 0.1])


def test_plan_scale_sites_reads_the_aligned_trainer_and_the_sites_against_the_chips_bf16(tmp_path):
    """Plan scale-sites' contrasts, each against bf16 (the chip's own library) by hand, and the
    site rounding's step-0 ratio (its runs set at half bf16's mismatch); a plan variant with no
    runs yet drops out of the table; plan scale-own on the same folder reads none of them."""
    root = relabel(folder(str(tmp_path)), "bf16-noamx", "bf16")
    relabel(root, "bf16-trunc", "bf16-aligned")
    relabel(root, "bf16-trunc-site-trunc", "bf16-site-trunc", m0=5e-5)
    small = scale.read(root, None, "scale-sites")["arms"]["gspo-engine"]
    assert list(small["variants"]) == ["bf16", "bf16-aligned", "bf16-site-trunc"]  # no rne6 yet
    pairs = {(t["a"], t["b"]): t for t in small["contrasts"]}
    assert set(pairs) == {("bf16-aligned", "bf16"), ("bf16-site-trunc", "bf16")}
    assert pairs[("bf16-aligned", "bf16")]["mean"] == pytest.approx((-0.75 - 0.06 - 0.64) / 3)
    assert pairs[("bf16-site-trunc", "bf16")]["mean"] == pytest.approx((0.01 - 0.01 + 0.01) / 3)
    assert list(small["step0_ratios"]) == ["bf16-site-trunc / bf16"]
    ratio = small["step0_ratios"]["bf16-site-trunc / bf16"]
    assert ratio["mean"] == pytest.approx(0.5) and ratio["range"] == pytest.approx([0.5, 0.5])
    assert list(scale.read(root, None, "scale-own")["arms"]["gspo-engine"]["variants"]) == ["bf16"]


def test_plan_scale_rne5_reads_the_size_dial_against_bf16_alone_and_its_size_over_truncations(tmp_path):
    """Plan scale-rne5: one contrast, rne5 - bf16, by hand (Holm over one: the nominal p), and rne5's
    step-0 size over site-trunc's and over bf16's (rne5 set at 2x bf16's mismatch, trunc at 0.5x)."""
    root = relabel(folder(str(tmp_path)), "bf16-noamx", "bf16")
    relabel(root, "bf16-trunc", "bf16-site-rne5", m0=2e-4)
    relabel(root, "bf16-trunc-site-trunc", "bf16-site-trunc", m0=5e-5)
    small = scale.read(root, None, "scale-rne5")["arms"]["gspo-engine"]
    assert list(small["variants"]) == ["bf16", "bf16-site-trunc", "bf16-site-rne5"]
    (test,) = small["contrasts"]
    assert (test["a"], test["b"]) == ("bf16-site-rne5", "bf16") and test["p_holm"] == test["p_sign_flip"]
    assert test["mean"] == pytest.approx((-0.75 - 0.06 - 0.64) / 3)
    ratios = small["step0_ratios"]
    assert ratios["bf16-site-rne5 / bf16-site-trunc"]["mean"] == pytest.approx(4.0)
    assert ratios["bf16-site-rne5 / bf16"]["range"] == pytest.approx([2.0, 2.0])


@pytest.mark.parametrize("plan, mode, other, other_mean", [
    ("scale-truncpm2", "truncpm2", ("bf16-trunc-site-trunc", "bf16-trunc"), 1.46 / 3),
    ("scale-sym", "sym", ("bf16-trunc-site-trunc", "bf16-trunc-site-sym"), 0.01 / 3)])
def test_scale_truncpm2_and_sym_read_the_mode_against_bf16_trunc(tmp_path, plan, mode, other,
                                                                  other_mean):
    """Plans scale-truncpm2 and scale-sym: the mode against bf16-trunc by hand, Holm over it and
    the plan's other contrast (truncpm2's: the cheap fix against bf16-trunc, +0.76, +0.05, +0.65;
    sym's: the cheap fix against sym, +0.01, -0.01, +0.01), and the mode's step-0 size over
    bf16-trunc's and the cheap fix's (set at 3x both); on the larger GPT, which has no cheap fix
    here, one contrast."""
    new = f"bf16-trunc-site-{mode}"
    root = relabel(folder(str(tmp_path)), "bf16-noamx", new, m0=3e-4)
    out = scale.read(root, None, plan)["arms"]
    small, large = out["gspo-engine"], out["gspo-engine-x8"]
    assert list(small["variants"]) == ["bf16-trunc", "bf16-trunc-site-trunc", new]
    pairs = {(t["a"], t["b"]): t for t in small["contrasts"]}
    step = pairs[(new, "bf16-trunc")]  # +0.75, +0.06, +0.64
    assert step["mean"] == pytest.approx(1.45 / 3) and step["p_sign_flip"] == 0.25
    assert step["tests_in_table"] == 2 and step["p_holm"] == pytest.approx(0.5)
    assert other in pairs and set(pairs) == {(new, "bf16-trunc"), other}
    assert pairs[other]["mean"] == pytest.approx(other_mean)
    for below in ("bf16-trunc", "bf16-trunc-site-trunc"):
        ratio = small["step0_ratios"][f"{new} / {below}"]
        assert ratio["mean"] == pytest.approx(3.0) and ratio["range"] == pytest.approx([3.0, 3.0])
    (only,) = large["contrasts"]  # +0.01, +0.86, +0.01
    assert (only["a"], only["b"], only["tests_in_table"]) == (new, "bf16-trunc", 1)
    assert only["mean"] == pytest.approx(0.88 / 3)


def test_plan_scale_grpo_reads_vanilla_grpo_on_both_gpts_and_no_gspo_run(tmp_path):
    """Plan scale-grpo: grpo-x8 beside grpo, site-trunc - bf16 on each by hand, and site-trunc's
    step-0 size over bf16's (set at half); the gspo arms' runs in the same folder are not read, and
    plan scale-sites on that folder reads them, not grpo's."""
    root = relabel(folder(str(tmp_path)), "bf16-noamx", "bf16")
    relabel(root, "bf16-trunc", "bf16-site-trunc", m0=5e-5)
    for large, small in (("gspo-engine-x8", "grpo-x8"), ("gspo-engine", "grpo")):
        for v, accs in HELDOUT[large].items():  # bf16-noamx and bf16-trunc, relabelled above
            v = {"bf16-noamx": "bf16", "bf16-trunc": "bf16-site-trunc"}.get(v, v)
            for seed in range(len(accs)):
                shutil.copytree(os.path.join(root, f"{large}-{v}-s{seed}"),
                                os.path.join(root, f"{small}-{v}-s{seed}"))
    out = scale.read(root, None, "scale-grpo")["arms"]
    assert list(out) == ["grpo", "grpo-x8"]
    (small,), (large,) = out["grpo"]["contrasts"], out["grpo-x8"]["contrasts"]
    assert (large["a"], large["b"]) == ("bf16-site-trunc", "bf16")
    assert large["mean"] == pytest.approx((-0.01 - 0.86 - 0.01) / 3)
    assert small["mean"] == pytest.approx((-0.75 - 0.06 - 0.64) / 3)
    assert out["grpo-x8"]["step0_ratios"]["bf16-site-trunc / bf16"]["mean"] == pytest.approx(0.5)
    assert list(scale.read(root, None, "scale-sites")["arms"]) == ["gspo-engine", "gspo-engine-x8"]
    with pytest.raises(SystemExit):
        scale.read(root, None, "scale-grpo", arms=["gspo-engine"])


def test_arms_reads_the_named_arm_alone_and_refuses_one_scale_does_not_read(tmp_path, capsys):
    """--arms gspo-engine: the larger GPT's runs in the folder are not read (its table, the same
    numbers as with both arms); an arm scale does not read is refused, exit 2, the line naming
    it alone; --arms with --warm-starts (a row is both arms) is refused before any reading."""
    root = folder(str(tmp_path))
    both = scale.read(root, None)["arms"]
    alone = scale.read(root, None, arms=["gspo-engine"])["arms"]
    assert list(alone) == ["gspo-engine"] and alone["gspo-engine"] == both["gspo-engine"]
    with pytest.raises(SystemExit) as e:
        scale.read(root, None, arms=["gspo"])
    assert e.value.code == 2
    capsys.readouterr()  # that refusal's line, cleared before the next is read
    with pytest.raises(SystemExit) as e:
        scale.read(root, None, arms=["gspo-engine", "gspo"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--arms gspo:" in err and "--arms gspo-engine" not in err
    with pytest.raises(SystemExit) as e:
        scale.main([root, "--warm-starts", "--arms", "gspo-engine",
                    "--out", str(tmp_path / "w.json")])
    assert e.value.code == 2 and not (tmp_path / "w.json").exists()
