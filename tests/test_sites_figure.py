"""experiments/sites_figure.py: the size-or-sign table by hand on hand-set runs (falls, step-0
sizes, each variant paired with its control, Holm, the growth before a fall without its own row),
and the matched-size table from hand-set anatomy readings."""
import json
import os

import pytest

import sites_figure

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["amx_tile"], "torch": "t", "vllm": "v", "host": "h"}
NOAMX = {"dtype": "bf16", "kernel_library": "_C", "amx_hidden": True}
HELDOUT = {"bf16-noamx": [0.95, 0.96, 0.94], "bf16-noamx-site-trunc": [0.2, 0.9, 0.3],
           "bf16-noamx-site-sym": [0.9, 0.95, 0.9]}
STEP0 = {"bf16-noamx": 2e-4, "bf16-noamx-site-trunc": 3e-4, "bf16-noamx-site-sym": 2.8e-4}


def rows(v, seed, acc):
    """Five rows; a run that fell drops below 0.5 reward at step 3, its mismatch 4x at step 2
    and 10x at step 3 (the fall's own row)."""
    m0, fell = STEP0[v] * (1 + seed), acc < 0.5
    mismatch = [m0, m0 * 2, m0 * (4 if fell else 1), m0 * (10 if fell else 1), m0]
    rest = {"pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3], "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0],
            "response_len_mean": 24.0, "entropy_mean": 0.1, "logit_rms": 3.0}  # what results.py reads
    return [{"step": s, "reward_mean": 0.3 if fell and s >= 3 else 0.9, "mismatch_logp_abs_mean": m,
             "mismatch_k1": -m / 10, **rest} for s, m in enumerate(mismatch)]


def folder(root):
    for v, accs in HELDOUT.items():
        for seed, acc in enumerate(accs):
            run = os.path.join(root, f"gspo-engine-{v}-s{seed}")
            os.makedirs(run)
            mode = v.rsplit("-", 1)[1] if "site" in v else None
            args = {**NOAMX, "seed": seed, "steps": 5, "machine": MACHINE,
                    **({"site_rounding": mode} if mode else {})}
            json.dump(args, open(os.path.join(run, "args.json"), "w"))
            json.dump({"accuracy": acc}, open(os.path.join(run, "heldout.json"), "w"))
            open(os.path.join(run, "metrics.jsonl"), "w").write(
                "\n".join(json.dumps(r) for r in rows(v, seed, acc)) + "\n")
    return root


def test_the_table_by_hand(tmp_path, capsys):
    out = sites_figure.read(folder(str(tmp_path)), None)
    cells = out["variants"]
    assert list(cells) == ["bf16-noamx", "bf16-noamx-site-trunc", "bf16-noamx-site-sym"]  # the plan's order
    assert cells["bf16-noamx-site-trunc"]["fell"] == 2 and cells["bf16-noamx-site-sym"]["fell"] == 0
    assert cells["bf16-noamx-site-trunc"]["step0_abs"] == pytest.approx([3e-4, 6e-4, 9e-4])
    assert cells["bf16-noamx-site-trunc"]["step0_signed"] == pytest.approx([-3e-5, -6e-5, -9e-5])
    growth = cells["bf16-noamx-site-trunc"]["growth_before_fall"]
    assert growth[0] == (3, pytest.approx(4.0)) and growth[1] is None  # step 2's 4x, not step 3's 10x
    tests = {(t["a"], t["b"]): t for t in out["contrasts"]}
    assert set(tests) == {("bf16-noamx-site-trunc", "bf16-noamx"), ("bf16-noamx-site-sym", "bf16-noamx")}
    trunc = tests[("bf16-noamx-site-trunc", "bf16-noamx")]  # -0.75, -0.06, -0.64
    assert trunc["mean"] == pytest.approx(-1.45 / 3) and trunc["p_sign_flip"] == 0.25  # 2 of 8 reach |sum|
    assert trunc["tests_in_table"] == 2 and trunc["p_holm"] == pytest.approx(0.5)
    sites_figure.print_read(out)
    printed = capsys.readouterr().out
    assert "| bf16-noamx-site-trunc | _C, AMX hidden | trunc | 6.000e-04 |" in printed
    assert "s0: 4.0x (step 3)" in printed


def anatomy(path, library, mode, size, signed=0.0, sha="abc", ckpt="runs/warmstart/w0"):
    json.dump({"experiment": "anatomy", "kernel_library": library, "site_rounding": mode,
               "checkpoint": ckpt, "tokens_sha1": sha,
               "variants": {"bf16": {"logp_abs_mean": size, "signed_mean": signed}}}, open(path, "w"))


def test_the_matched_size_table_by_hand_and_one_set_of_tokens(tmp_path, capsys):
    os.makedirs(tmp_path / "sites")
    json.dump({"experiment": "sites-cost"}, open(tmp_path / "sites" / "cost.json", "w"))  # not a reading
    for name, lib, mode, size in (("noamx-rne", "_C", "rne", 2e-4), ("noamx-trunc", "_C", "trunc", 3e-4),
                                  ("noamx-away", "_C", "away", 4e-4), ("trunc-rne", "_C_AVX512", "rne", 4.5e-4)):
        anatomy(tmp_path / "sites" / f"{name}.json", lib, mode, size)
    out = sites_figure.matched(str(tmp_path))["rows"]
    assert out["rounding-away"]["over_site_trunc"] == pytest.approx(4 / 3)
    assert out["rounding-rne"]["over_engine_trunc"] == pytest.approx(2 / 4.5)
    printed = capsys.readouterr().out
    assert "| rounding (_C) | away | 4.000e-04 | +0.00e+00 | 1.33 | 0.75x | 0.89 |" in printed
    assert "| rounding (_C) | trunc | 3.000e-04 | +0.00e+00 | 1.00 | - | 0.67 |" in printed
    anatomy(tmp_path / "sites" / "noamx-sym.json", "_C", "sym", 2.8e-4, sha="other")
    with pytest.raises(SystemExit) as e:  # readings of other tokens are not one table
        sites_figure.matched(str(tmp_path))
    assert e.value.code == 2


def test_the_matched_size_table_of_another_folder_is_one_checkpoints(tmp_path, capsys):
    """--matched scale-sites: the 7M GPT's readings, apart from the 0.9M GPT's in sites/."""
    for folder, size in (("sites", 3e-4), ("scale-sites", 1.5e-4)):
        os.makedirs(tmp_path / folder)
        anatomy(tmp_path / folder / "own-trunc.json", "_C", "trunc", size, ckpt=folder)
        anatomy(tmp_path / folder / "trunc-rne.json", "_C_AVX512", "rne", 2 * size, ckpt=folder)
    out = sites_figure.matched(str(tmp_path), "scale-sites")
    assert out["checkpoint"] == "scale-sites"
    assert out["rows"]["rounding-trunc"]["logp_abs_mean"] == 1.5e-4
    assert out["rows"]["truncating-rne"]["over_site_trunc"] == pytest.approx(2.0)
    anatomy(tmp_path / "scale-sites" / "own-rne6.json", "_C", "rne6", 1e-4, ckpt="other")
    with pytest.raises(SystemExit) as e:  # the same tokens' digest from other weights: refused
        sites_figure.matched(str(tmp_path), "scale-sites")
    assert e.value.code == 2


def test_the_matched_size_table_where_every_library_truncates(tmp_path, capsys):
    """AVX2 alone: no rounding engine, each row over the truncating engine's against the trainer's
    rne, the ratio to the trainer's trunc against a rounding engine left empty; no rne, refused."""
    os.makedirs(tmp_path / "sites")
    for mode, size in (("trunc", 1.8e-4), ("rne6", 4.4e-4)):
        anatomy(tmp_path / "sites" / f"own-{mode}.json", "_C_AVX2", mode, size)
    with pytest.raises(SystemExit) as e:
        sites_figure.matched(str(tmp_path))
    assert e.value.code == 2
    anatomy(tmp_path / "sites" / "own-rne.json", "_C_AVX2", "rne", 4e-4)
    out = sites_figure.matched(str(tmp_path))["rows"]
    assert out["truncating-trunc"]["over_engine_trunc"] == pytest.approx(0.45)
    assert out["truncating-rne6"]["over_site_trunc"] is None
    printed = capsys.readouterr().out
    assert "| truncating (_C_AVX2) | rne6 | 4.400e-04 | +0.00e+00 | - | - | 1.10 |" in printed


def test_the_figure_and_its_json(tmp_path):
    out = str(tmp_path / "sites.png")
    sites_figure.main([folder(str(tmp_path / "runs")), "--out", out])
    data = json.load(open(out.replace(".png", ".json")))
    assert os.path.getsize(out) > 0 and data["variants"]["bf16-noamx-site-trunc"]["fell"] == 2


def test_variants_read_those_records_alone_with_holm_over_their_contrasts(tmp_path, capsys):
    """--variants: a chip's second part of the plan read apart from its first. The control and sym
    alone: one contrast (-0.05, -0.01, -0.04: of the 8 sign flips only the two of one sign reach
    |0.10|, p 2 of 8), Holm over one; a name in no plan is refused before any reading."""
    root = folder(str(tmp_path / "runs"))
    out = sites_figure.read(root, None, variants=["bf16-noamx", "bf16-noamx-site-sym"])
    assert list(out["variants"]) == ["bf16-noamx", "bf16-noamx-site-sym"]
    (sym,) = out["contrasts"]
    assert sym["mean"] == pytest.approx(-0.1 / 3) and sym["p_sign_flip"] == 0.25
    assert sym["tests_in_table"] == 1 and sym["p_holm"] == sym["p_sign_flip"]
    with pytest.raises(SystemExit) as e:
        sites_figure.main([root, "--variants", "bf16-noamx", "bf16-site-nope", "--out",
                           str(tmp_path / "x.png")])
    assert e.value.code == 2 and not os.path.exists(tmp_path / "x.png")
    assert "bf16-site-nope" in capsys.readouterr().err


def test_contrasts_named_replace_the_controls_with_holm_over_them(tmp_path, capsys):
    """--contrast A B: A minus B for the pairs given alone. sym - trunc (+0.7, +0.05, +0.6: 2 of 8
    sign flips reach +1.35, p 0.25) and trunc - the control (p 0.25): Holm over two, 0.5 each; a
    contrast naming a variant not read is refused (exit 2) before any figure."""
    root = folder(str(tmp_path / "runs"))
    pairs = [("bf16-noamx-site-sym", "bf16-noamx-site-trunc"),
             ("bf16-noamx-site-trunc", "bf16-noamx")]
    out = sites_figure.read(root, None, contrasts=pairs)
    tests = {(t["a"], t["b"]): t for t in out["contrasts"]}
    assert list(tests) == pairs
    sym = tests[pairs[0]]
    assert sym["mean"] == pytest.approx(1.35 / 3) and sym["p_sign_flip"] == 0.25
    assert all(t["tests_in_table"] == 2 and t["p_holm"] == pytest.approx(0.5) for t in tests.values())
    with pytest.raises(SystemExit) as e:
        sites_figure.main([root, "--variants", "bf16-noamx", "bf16-noamx-site-trunc", "--contrast",
                           "bf16-noamx-site-sym", "bf16-noamx", "--out", str(tmp_path / "x.png")])
    assert e.value.code == 2 and not os.path.exists(tmp_path / "x.png")
    assert "bf16-noamx-site-sym" in capsys.readouterr().err

def test_fisher_and_the_overlap_by_hand():
    """Fisher's one-sided p by hand: 0 of 3 zero-mean runs fell when 2 of 5 did, C(3,3)/C(5,3)
    = 1/10. The overlap: runs of each kind inside the window where both kinds ran."""
    assert sites_figure.fisher_one_sided(0, 3, 2, 5) == pytest.approx(0.1)
    assert sites_figure.fisher_one_sided(2, 3, 2, 5) == pytest.approx(1.0)
    cells = {"bf16-noamx": {"step0_abs": [1e-4, 3e-4], "heldout": [0.9, 0.9]},  # zero-mean
             "bf16-noamx-site-trunc": {"step0_abs": [2e-4, 4e-4], "heldout": [0.1, 0.2]},
             "bf16-noamx-site-sym": {"step0_abs": [2.5e-4, 5e-4], "heldout": [0.9, 0.9]},
             "bf16-trunc-site-trunc": {"step0_abs": [3e-4], "heldout": [0.1]}}  # unclassified
    o = sites_figure.overlap(cells)
    assert o["window"] == [2e-4, 4e-4]  # one-signed from 2e-4, zero-mean up to 5e-4
    assert o["one_signed"] == [2, 2] and o["zero_mean"] == [0, 2]  # 2.5e-4 and 3e-4 inside
    assert o["p_fisher_one_sided"] == pytest.approx(1 / 6)  # C(2,2) / C(4,2)
    apart = {"bf16-noamx": {"step0_abs": [1e-4, 2e-4], "heldout": [0.9, 0.9]},
             "bf16-noamx-site-trunc": {"step0_abs": [3e-4, 4e-4], "heldout": [0.9, 0.9]}}
    assert sites_figure.overlap(apart) is None  # no size both kinds ran at
    held = {v: {**c, "heldout": [0.9] * len(c["heldout"])} for v, c in cells.items()}
    assert sites_figure.overlap(held) is None  # both kinds at one size, but no run fell


def test_the_chips_own_library_is_classed_by_its_isa(tmp_path):
    """The chip's own library rounds with AVX-512-BF16 and no AMX, truncates without
    AVX-512-BF16, and is neither with AMX; the aligned trainer, no error, is never classed."""
    classes = {}
    for name, isa in (("rounds", ["avx512_bf16"]), ("truncates", ["avx2"]),
                      ("amx", ["avx512_bf16", "amx_tile"])):
        os.makedirs(tmp_path / name / "run")
        with open(tmp_path / name / "run" / "args.json", "w") as f:
            json.dump({"machine": {**MACHINE, "cpu_isa": isa}}, f)
        classes[name] = sites_figure.own_library(str(tmp_path / name))
    assert classes == {"rounds": "rounds", "truncates": "truncates", "amx": None}
    sign = sites_figure.sign_of
    assert [sign("bf16", own) for own in ("rounds", "truncates", None)] == [
        "zero-mean", "one-signed", None]
    assert [sign(f"bf16-site-{m}", "rounds") for m in ("trunc", "away", "rne6", "sym")] == [
        "one-signed", "one-signed", "zero-mean", "zero-mean"]
    assert sign("bf16-site-trunc", "truncates") is None  # truncation against truncation
    assert sign("bf16-aligned", "rounds") is None
    assert sign("bf16-trunc", "rounds") == "one-signed"  # the library forced, whatever the chip


def test_growth_names_the_falls_and_the_dips_that_held(capsys):
    """A fallen run shows its growth; a run whose batch reward fell below 0.5 but whose held-out
    did not is named apart; a run that never dipped, neither."""
    cells = {"bf16-noamx-site-trunc": {"seeds": [0, 1, 2], "heldout": [0.2, 0.9, 0.95],
                                       "growth_before_fall": [(3, 4.0), (7, 2.5), None]},
             "bf16-noamx": {"seeds": [0], "heldout": [0.9], "growth_before_fall": [None]}}
    sites_figure.print_growth(cells)
    lines = capsys.readouterr().out.splitlines()
    assert "  bf16-noamx-site-trunc: s0: 4.0x (step 3); a batch's reward below 0.5, held: s1 (step 7)" in lines
    assert "  bf16-noamx: no fall" in lines


def test_each_variants_control_is_its_record_with_the_trainer_as_it_is():
    """The paired control: the same record, the trainer rounding to nearest at the sites and its
    embedding's backward torch's, its attention the emulation's (plans embed32's and gpulike's
    beside plan sites')."""
    pairs = {"bf16-site-trunc": "bf16", "bf16-noamx-site-away": "bf16-noamx",
             "bf16-noamx-site-nudge": "bf16-noamx",
             "bf16-trunc-site-rne6": "bf16-trunc", "bf16-embed32": "bf16",
             "bf16-trunc-embed32": "bf16-trunc", "bf16-gpulike": "bf16",
             "bf16-trunc-gpulike": "bf16-trunc", "bf16-trunc-fused": "bf16-trunc",
             "bf16-trunc-embedrev": "bf16-trunc", "bf16-trunc-site-sym": "bf16-trunc",
             "bf16-trunc-site-nudge": "bf16-trunc", "bf16-trunc-site-nudge16": "bf16-trunc",
             "bf16-trunc-site-nudge8": "bf16-trunc", "bf16-trunc-site-nudge3of16": "bf16-trunc",
             "bf16-trunc-site-nudge3of8": "bf16-trunc",
             "bf16-trunc-site-nudge7of16": "bf16-trunc",
             "bf16-trunc-site-trunc1of2": "bf16-trunc",
             "bf16-trunc-site-trunc1of4": "bf16-trunc", "bf16": None,
             "bf16-trunc": None}
    assert {v: sites_figure.control_of(v) for v in pairs} == pairs
