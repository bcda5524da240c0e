"""experiments/rounding.py: the kernel library vLLM loads for this chip rounds bf16 as the chip
predicts: truncation in _C_AVX2 and _C_AVX512 (the #else branch), to nearest in _C (AVX-512-BF16);
fp16 to nearest everywhere. Fails if a vLLM upgrade changes the rounding under the project."""
import pytest

import rounding


def test_the_loaded_library_rounds_bf16_as_its_chip_predicts(engine):
    engine("bfloat16")  # the session's engines load the library vLLM picks for this chip
    result = rounding.probe()
    ops = result["ops"]
    for name in ("rotary_embedding", "attention"):  # the kernels on the model's path
        bf16, fp16 = ops[name]["bf16"], ops[name]["fp16"]
        if result["library"] in ("_C_AVX2", "_C_AVX512"):
            assert bf16["match_truncation"] == 1.0 and bf16["match_nearest"] < 0.9, (name, bf16)
            assert bf16["magnitude_bias"] < -1e-3  # one-signed: every output shrinks
        else:
            assert bf16["match_nearest"] > 0.99, (name, bf16)
        assert fp16["match_nearest"] > 0.99 and abs(fp16["magnitude_bias"]) < 1e-5, (name, fp16)


def test_a_library_the_chip_cannot_run_is_refused_in_one_line(capsys):
    for library, flag in rounding.LIBRARIES.items():
        if flag not in rounding.machine()["cpu_isa"]:  # the ISA flags instruments.machine reads
            with pytest.raises(SystemExit) as e:
                rounding.main(["--library", library])
            assert e.value.code == 2 and flag in capsys.readouterr().err
