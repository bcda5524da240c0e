"""experiments/swap.py: the swap's table by hand on a folder of runs with hand-set outcomes:
variants named from args.json, falls, the paired contrasts with Holm, the factor at the swap
and the held-out at the swap from the stops."""
import json
import os

import pytest

import swap
from variants import LATE_SWAP, SWAP_STEP, SWAPS, VARIANTS

MACHINE = {"cpu": "chip", "gpu": None, "cpu_isa": ["avx2"], "torch": "t", "vllm": "v", "host": "h"}
ARGS = {"bf16-trunc": {"kernel_library": "_C_AVX512"}, "bf16-noamx": {"kernel_library": "_C", "amx_hidden": True},
        "bf16-trunc-to-noamx": {"kernel_library": "_C", "amx_hidden": True, "swap_from": "bf16-trunc", "swap_step": SWAP_STEP},
        "bf16-noamx-to-trunc": {"kernel_library": "_C_AVX512", "swap_from": "bf16-noamx", "swap_step": SWAP_STEP}}
ARGS.update({f"{v}-at{LATE_SWAP}": {**ARGS[v], "swap_step": LATE_SWAP} for v in list(ARGS) if "-to-" in v})
HELDOUT = {"bf16-trunc": [0.2, 0.3, 0.9], "bf16-noamx": [0.96, 0.95, 0.97],
           "bf16-trunc-to-noamx": [0.7, 0.9, 0.9], "bf16-noamx-to-trunc": [0.9, 0.4, 0.8]}
MISMATCH = {"bf16-trunc": 4e-3, "bf16-noamx": 1e-3, "bf16-trunc-to-noamx": 2e-3,
            "bf16-noamx-to-trunc": 2.5e-3}  # each variant's on update SWAP_STEP (and LATE_SWAP)
SITE = {f"bf16-trunc{to}site-{m}": {"kernel_library": "_C_AVX512", "site_rounding": m, **swapped}
        for m in ("trunc", "rne6")
        for to, swapped in (("-", {}), ("-to-", {"swap_from": "bf16-trunc", "swap_step": SWAP_STEP}))}
ARGS.update(SITE)  # the trainer's site rounding swapped (variants.SITE_SWAPS), their after sides
SITE_HELDOUT = {"bf16-trunc": HELDOUT["bf16-trunc"], "bf16-trunc-to-noamx": HELDOUT["bf16-trunc-to-noamx"],
                "bf16-trunc-to-site-trunc": [0.9, 0.95, 0.92], "bf16-trunc-site-trunc": [0.96, 0.95, 0.95],
                "bf16-trunc-to-site-rne6": [0.45, 0.8, 0.85], "bf16-trunc-site-rne6": [0.8, 0.7, 0.9]}
MISMATCH.update({"bf16-trunc-to-site-trunc": 2e-3, "bf16-trunc-site-trunc": 2e-3,
                 "bf16-trunc-to-site-rne6": 5e-3, "bf16-trunc-site-rne6": 5e-3})
LATE = {"bf16-trunc-to-noamx-at20": [0.5, 0.6, 0.8], "bf16-noamx-to-trunc-at20": [0.95, 0.9, 0.9]}
MISMATCH.update({"bf16-trunc-to-noamx-at20": 1e-3, "bf16-noamx-to-trunc-at20": 3e-3})


def write_run(folder, name, args, acc, rows):
    run = os.path.join(folder, name)
    os.makedirs(run)
    for f, text in (("args.json", json.dumps(args)), ("heldout.json", json.dumps({"accuracy": acc})),
                    ("metrics.jsonl", "\n".join(json.dumps(r) for r in rows))):
        open(os.path.join(run, f), "w").write(text + "\n")


def rows_of(v, seed, n):
    rest = {"pi_bucket_frac": [0.1, 0.1, 0.2, 0.3, 0.3], "pi_bucket_logp_abs_mean": [1e-3, 1e-4, 1e-5, 1e-6, 0.0],
            "response_len_mean": 24.0, "entropy_mean": 0.1, "logit_rms": 3.0}
    mismatch = [MISMATCH[v] * (1 + seed) if s in (SWAP_STEP, LATE_SWAP) else 1e-4 for s in range(n)]
    return [{"step": s, "reward_mean": 0.9, "mismatch_logp_abs_mean": m, **rest} for s, m in enumerate(mismatch)]


def swap_folder(root, late=False, heldout=HELDOUT):
    """Whole runs of SWAP_STEP + 1 rows (LATE_SWAP + 1 with late, and the later swaps); the
    stops of the unswapped variants at SWAP_STEP (and LATE_SWAP), held-out half (a third)."""
    folder, n = os.path.join(root, "chip"), (LATE_SWAP if late else SWAP_STEP) + 1
    for v, accs in {**heldout, **(LATE if late else {})}.items():
        for seed, acc in enumerate(accs):
            args = {"dtype": "bf16", "seed": seed, "steps": n, "machine": MACHINE, **ARGS[v]}
            write_run(folder, f"gspo-engine-{v}-s{seed}", args, acc, rows_of(v, seed, n))
            for step, part in ((SWAP_STEP, 2), (LATE_SWAP, 3))[:1 + late] if "-to-" not in v else ():
                stop = {**args, "stop_after": step}
                write_run(os.path.join(folder, f"step{step}"), f"gspo-engine-{v}-s{seed}", stop,
                          acc / part, rows_of(v, seed, step))
    return folder


def test_the_swaps_table_by_hand(tmp_path, capsys):
    out = swap.read(swap_folder(str(tmp_path)), None)
    cells = out["variants"]
    assert list(cells) == swap.order(SWAP_STEP) == swap.FIRST
    assert cells["bf16-trunc"]["fell"] == 2 and cells["bf16-noamx-to-trunc"]["fell"] == 1
    assert cells["bf16-trunc-to-noamx"]["heldout_at_swap"] == [0.1, 0.15, 0.45]  # the trunc stops'
    assert cells["bf16-noamx"]["heldout_at_swap"] == [0.48, 0.475, 0.485]
    tests = {(t["a"], t["b"]): t for t in out["contrasts"]}
    rescue = tests[("bf16-trunc-to-noamx", "bf16-trunc")]  # differences +0.5, +0.6, 0.0
    assert abs(rescue["mean"] - 1.1 / 3) < 1e-12 and rescue["n"] == 3
    assert rescue["p_sign_flip"] == 0.5  # 4 of 8 sign patterns reach |sum| 1.1 (the zero's flip changes nothing)
    assert rescue["tests_in_table"] == 4 and rescue["p_holm"] >= rescue["p_sign_flip"]
    factors = out["factor_at_swap"]  # 2e-3 over 4e-3 at every seed; 2.5e-3 over 1e-3
    assert all(abs(x - 0.5) < 1e-12 for x in factors["bf16-trunc-to-noamx"]["by_seed"].values())
    assert abs(factors["bf16-noamx-to-trunc"]["geometric_mean"] - 2.5) < 1e-12
    swap.print_read(out)
    assert "| bf16-trunc | 0.4667" in capsys.readouterr().out


def test_the_site_swaps_table_by_hand(tmp_path, capsys):
    """--swaps site: bf16-trunc's runs on from its stop with the trainer's site rounding changed,
    against their before side and their after sides run from the start (Holm over four); the
    engine's rescue a row beside them, its factor read, outside the contrasts."""
    out = swap.read(swap_folder(str(tmp_path), heldout=SITE_HELDOUT), None, swaps="site")
    cells = out["variants"]
    assert list(cells) == swap.order(SWAP_STEP, "site") == swap.SETS["site"][1]
    assert cells["bf16-trunc-to-site-rne6"]["heldout_at_swap"] == [0.1, 0.15, 0.45]  # the trunc stops'
    assert cells["bf16-trunc-to-site-rne6"]["fell"] == 1 and cells["bf16-trunc-to-site-trunc"]["fell"] == 0
    tests = {(t["a"], t["b"]): t for t in out["contrasts"]}
    assert set(tests) == {("bf16-trunc-to-site-trunc", "bf16-trunc"), ("bf16-trunc-to-site-rne6", "bf16-trunc"),
                          ("bf16-trunc-to-site-trunc", "bf16-trunc-site-trunc"),
                          ("bf16-trunc-to-site-rne6", "bf16-trunc-site-rne6")}
    fix = tests[("bf16-trunc-to-site-trunc", "bf16-trunc")]  # differences +0.7, +0.65, +0.02
    assert abs(fix["mean"] - 1.37 / 3) < 1e-12 and fix["tests_in_table"] == 4
    assert fix["p_sign_flip"] == 0.25  # flipping 0.02 leaves |sum| 1.33: 2 of 8 patterns reach 1.37
    factors = out["factor_at_swap"]  # 2e-3 and 5e-3 over 4e-3; the engine's rescue 2e-3 too
    assert abs(factors["bf16-trunc-to-site-trunc"]["geometric_mean"] - 0.5) < 1e-12
    assert abs(factors["bf16-trunc-to-site-rne6"]["geometric_mean"] - 1.25) < 1e-12
    assert abs(factors["bf16-trunc-to-noamx"]["geometric_mean"] - 0.5) < 1e-12
    swap.print_read(out)
    assert "| bf16-trunc-to-site-trunc | 0.9233" in capsys.readouterr().out


@pytest.mark.parametrize("swaps", list(swap.SETS))
def test_each_set_reads_both_sides_of_its_swaps_on_one_kind_of_chip(swaps):
    """A set's contrasts need each swap's before and after sides among its rows; its swaps run
    on the same chips (site: a chip whose own library rounds; site-own: one that truncates)."""
    first, rows = swap.SETS[swaps]
    first = [v for v in first if SWAPS[v][2] == SWAP_STEP]  # the rows are SWAP_STEP's
    assert first and all({SWAPS[v][0], v, SWAPS[v][1]} <= set(rows) for v in first)
    chips = {(VARIANTS[v].needs, VARIANTS[v].lacks) for v in first}
    assert len({frozenset(n) for n, _ in chips}) == 1 and len({lacks for _, lacks in chips}) == 1


def test_the_later_swaps_table_beside_the_first_by_hand(tmp_path):
    """--step LATE_SWAP: the later swaps after their first ones, each with its own stop's held-out
    and its own update's factor; six contrasts, the later swap against the first among them."""
    out = swap.read(swap_folder(str(tmp_path), late=True), None, LATE_SWAP)
    cells, late = out["variants"], f"-at{LATE_SWAP}"
    assert list(cells) == ["bf16-noamx", "bf16-noamx-to-trunc", "bf16-noamx-to-trunc" + late, "bf16-trunc",
                           "bf16-trunc-to-noamx", "bf16-trunc-to-noamx" + late]
    assert cells["bf16-trunc-to-noamx" + late]["heldout_at_swap"] == pytest.approx([0.2 / 3, 0.1, 0.3])
    assert cells["bf16-trunc-to-noamx"]["heldout_at_swap"] == [0.1, 0.15, 0.45]  # still the first stops'
    assert cells["bf16-trunc"]["heldout_at_swap"] == pytest.approx([0.2 / 3, 0.1, 0.3])
    tests = {(t["a"], t["b"]): t for t in out["contrasts"]}
    assert len(tests) == 6 and all(t["tests_in_table"] == 6 for t in tests.values())
    waited = tests[("bf16-trunc-to-noamx" + late, "bf16-trunc-to-noamx")]  # -0.2, -0.3, -0.1
    assert abs(waited["mean"] + 0.2) < 1e-12 and waited["p_sign_flip"] == 0.25  # 2 of 8 reach |sum| 0.6
    factors = out["factor_at_swap"]  # on update LATE_SWAP: 1e-3 over 4e-3, 3e-3 over 1e-3
    assert abs(factors["bf16-trunc-to-noamx" + late]["geometric_mean"] - 0.25) < 1e-12
    assert abs(factors["bf16-noamx-to-trunc" + late]["geometric_mean"] - 3.0) < 1e-12
    assert abs(factors["bf16-noamx-to-trunc"]["geometric_mean"] - 2.5) < 1e-12  # on update SWAP_STEP
    swap.main([swap_folder(str(tmp_path / "again"), late=True), "--step", str(LATE_SWAP),
               "--out", str(tmp_path / "late.png")])
    assert json.load(open(tmp_path / "late.json"))["variants"] == json.loads(json.dumps(cells))


def test_the_swaps_figure_and_its_json(tmp_path):
    out = str(tmp_path / "swap.png")
    swap.main([swap_folder(str(tmp_path)), "--out", out])
    data = json.load(open(out.replace(".png", ".json")))
    assert os.path.getsize(out) > 0 and data["swap_step"] == SWAP_STEP
    assert data["variants"]["bf16-trunc-to-noamx"]["reward"]["x"] == list(range(SWAP_STEP + 1))


@pytest.mark.parametrize("flags, says", [(["--arms", "grpo"], "gspo-engine"),
                                         (["--swaps", "site", "--step", str(LATE_SWAP)], "--swaps site")])
def test_another_arm_or_a_late_site_swap_is_refused_in_one_line(tmp_path, capsys, flags, says):
    folder = swap_folder(str(tmp_path))
    with pytest.raises(SystemExit) as e:
        swap.main([folder, *flags, "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "x.png").exists()
