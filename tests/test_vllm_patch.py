"""experiments/vllm_patch/: the patch for vLLM. Where g++ is present, the patched conversions equal
round-to-nearest-even on all 2^32 float32 patterns, per path the chip runs, and today's AVX2 path
does not; the program's patched statements are the diff's own lines; the offered regression test
passes on a library that rounds and fails on one that truncates (each in a process of its own)."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT
from instruments import machine

PATCH = os.path.join(ROOT, "experiments", "vllm_patch")
sys.path[:0] = [PATCH]
import check  # noqa: E402  (experiments/vllm_patch/check.py, after its folder is on the path)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ here: the exhaustive check needs it")
def test_the_patched_conversions_round_to_nearest_even_on_every_pattern():
    rows = check.exhaustive()
    isa = machine()["cpu_isa"]
    want = {"scalar storeFP32 (patched)"}
    want |= {"AVX2 BF16Vec8 (patched)", "AVX2 BF16Vec8 (vLLM today)"} if "avx2" in isa else set()
    if "avx512f" in isa:  # with BW and VL, as on every chip vLLM loads _C_AVX512 on
        want |= {"AVX-512F BF16Vec16 (patched)", "AVX-512F BF16Vec8 (patched)"}
    assert set(rows) == want and all(r["patterns"] == 2 ** 32 for r in rows.values())
    for path, r in rows.items():
        assert (r["mismatches"] > 2 ** 30) if "today" in path else (r["mismatches"] == 0), (path, r)


def test_the_programs_patched_statements_are_the_diffs_lines():
    """Each statement of the program's patched vector functions is a line the diff adds or keeps
    (the vector names aside), so the check checks the diff's code."""
    source = open(os.path.join(PATCH, "bf16_rne_check.cpp")).read()
    diff = open(os.path.join(PATCH, "cpu_types_x86.diff")).read().splitlines()
    kept = {line[1:].strip() for line in diff if line[:1] in "+ "}
    for fn in ("avx2_patched", "avx512_patched", "avx512vl_patched"):
        body = re.search(fn + r"\([^)]*\) \{\n(.*?)\n\}", source, re.S).group(1)
        for statement in (s.strip() for s in body.splitlines()):
            assert statement in kept, (fn, statement)


def regression(library, folder):
    out = os.path.join(folder, f"regression-{library}.json")
    subprocess.run([sys.executable, os.path.join(PATCH, "check.py"), "regression", "--library",
                    library, "--json", out], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.load(open(out))["result"]


def test_the_offered_regression_test_fails_truncation_and_passes_rounding(tmp_path):
    isa = machine()["cpu_isa"]
    truncating = "_C_AVX512" if "avx512f" in isa else "_C_AVX2"
    assert regression(truncating, tmp_path) == {"library": truncating, "passed": False,
                                                "exit_status": 1}
    if "avx512_bf16" in isa:  # the library that rounds: only on a chip with AVX-512-BF16
        assert regression("_C", tmp_path)["passed"]
