"""experiments/rounding.py: the kernel library vLLM loads for this chip rounds bf16 as the chip
predicts: truncation in _C_AVX2 and _C_AVX512 (the #else branch), to nearest in _C (AVX-512-BF16);
fp16 to nearest everywhere. On a chip with AVX-512-BF16 the truncating library, forced through
vLLM's loader as plan rounding's -trunc runs force it, truncates too. Fails if a vLLM upgrade
changes the rounding under the project."""
import json
import os
import subprocess
import sys

import pytest

import anatomy
import campaign
import rounding
from variants import VARIANTS

ON_PATH = ("rotary_embedding", "attention")  # the kernels on the model's path


def assert_truncates(ops):
    for name in ON_PATH:
        bf16 = ops[name]["bf16"]
        assert bf16["match_truncation"] == 1.0 and bf16["match_nearest"] < 0.9, (name, bf16)
        assert bf16["magnitude_bias"] < -1e-3  # one-signed: every output shrinks


def test_the_loaded_library_rounds_bf16_as_its_chip_predicts(engine):
    engine("bfloat16")  # the session's engines load the library vLLM picks for this chip
    result = rounding.probe()
    ops = result["ops"]
    if result["library"] in ("_C_AVX2", "_C_AVX512"):
        assert_truncates(ops)
    else:
        assert ops["rotary_embedding"]["bf16"]["match_nearest"] > 0.99
        attention = ops["attention"]["bf16"]
        if result["attention_isa"]["bf16"] == "amx":  # bf16 products inside: not the
            assert attention["match_truncation"] < 0.9  # float32 result rounded, nor truncated
            assert attention["magnitude_bias"] > -1e-3, attention  # no one-signed shrink
            assert ops["attention_vec"]["bf16"]["match_nearest"] > 0.99  # the library rounds
            assert attention["match_amx_model"] > 0.99  # weights in bf16, to nearest, before V
        else:
            assert attention["match_nearest"] > 0.99, attention
    for name in ON_PATH:
        fp16 = ops[name]["fp16"]
        assert fp16["match_nearest"] > 0.99 and abs(fp16["magnitude_bias"]) < 1e-5, (name, fp16)


def test_the_forced_truncating_library_truncates_on_a_rounding_chip(tmp_path):
    if "avx512_bf16" not in rounding.machine()["cpu_isa"]:
        pytest.skip("the chip's own library truncates: the test above covers it")
    out = tmp_path / "rounding.json"  # a process of its own: one kernel library a process
    script = os.path.join(os.path.dirname(rounding.__file__), "rounding.py")
    cmd = [sys.executable, script, "--library", "_C_AVX512", "--json", str(out)]
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(out.read_text())
    assert result["library"] == "_C_AVX512" and result["attention_isa"]["bf16"] == "vec"
    assert_truncates(result["ops"])


def campaign_run(argv):
    campaign.main(["--run", *argv, "--", "--dtype", "bf16"])


def test_a_library_the_chip_cannot_run_is_refused_in_one_line(capsys):
    for library, flag in rounding.LIBRARIES.items():
        if flag not in rounding.machine()["cpu_isa"]:  # the ISA flags instruments.machine reads
            forced = [v.name for v in VARIANTS.values() if v.library == library]
            calls = [(main, ["--library", library]) for main in (rounding.main, anatomy.main)]
            for main, argv in calls + [(campaign_run, ["--variant", v]) for v in forced]:
                with pytest.raises(SystemExit) as e:  # before any work
                    main(argv)
                assert e.value.code == 2 and flag in capsys.readouterr().err


def test_hiding_amx_where_there_is_none_is_refused_in_one_line(monkeypatch, capsys):
    """AMX hidden (plan rounding's bf16-noamx) on a chip without AMX: it would repeat bf16, so one
    line and exit 2, before any work; the libraries that chip can run pass the same check."""
    monkeypatch.setattr(rounding, "machine", lambda: {"cpu_isa": ["avx2", "avx512f", "avx512_bf16"]})
    with pytest.raises(SystemExit) as e:
        campaign_run(["--variant", "bf16-noamx"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "AMX" in err, err
    rounding.refuse_unrunnable("_C")  # AVX-512-BF16 is there: no refusal
