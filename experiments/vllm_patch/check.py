"""
experiments/vllm_patch/check.py: the checks behind the patch for vLLM (cpu_types_x86.diff,
pr.md). Two, each a process of its own:

    python experiments/vllm_patch/check.py exhaustive             # all 2^32 float32 patterns
    python experiments/vllm_patch/check.py regression             # on the library vLLM picks
    python experiments/vllm_patch/check.py regression --library _C_AVX512   # a truncating one

exhaustive: compiles bf16_rne_check.cpp with the system's g++ and runs it: the patched
conversions (AVX2, AVX-512F, scalar) against c10's round_to_nearest_even on every pattern, and
vLLM's AVX2 conversion of today beside them. regression: runs test_cpu_bf16_rounding.py (the
test offered to vLLM) with pytest, on the kernel library given (rounding.load, before vLLM's ops
load: one library a process): it passes where the kernels round, fails where they truncate.
--json F writes what it printed, parsed. Page: experiments/report.md.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]  # experiments/: common, rounding

import common  # noqa: E402  (after the path: experiments/ is not a package)

SOURCE = os.path.join(HERE, "bf16_rne_check.cpp")
TEST = os.path.join(HERE, "test_cpu_bf16_rounding.py")

def exhaustive():
    """{path: mismatches} over all 2^32 patterns; None where there is no g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "bf16_rne_check")
        subprocess.run([gxx, "-O2", "-o", binary, SOURCE], check=True)
        out = subprocess.run([binary], check=True, capture_output=True, text=True).stdout
    print(out, end="")
    rows = re.findall(r"^(.+?)\s+patterns (\d+) mismatches (\d+)$", out, re.M)
    return {path: {"patterns": int(n), "mismatches": int(bad)} for path, n, bad in rows}

def regression(library=None):
    """pytest's summary line and exit status for the offered test on `library`."""
    import pytest
    import rounding

    rounding.refuse_unrunnable(library)
    loaded = rounding.load(library)  # before vLLM's ops: the library this process keeps
    status = pytest.main(["-q", "-p", "no:cacheprovider", TEST])
    return {"library": loaded, "passed": status == 0, "exit_status": int(status)}

def main(argv=None):
    p = common.parser("the checks behind the patch for vLLM (the docstring)")
    p.add_argument("check", choices=["exhaustive", "regression"])
    p.add_argument("--library", default=None, help="regression: vLLM's kernels from this one")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    common.writable(args.json)
    result = exhaustive() if args.check == "exhaustive" else regression(args.library)
    if result is None:
        common.refuse("exhaustive: no g++ on this machine")
    print(result)
    if args.json:
        common.write_json(args.json, {"check": args.check, "result": result})

if __name__ == "__main__":
    main()
