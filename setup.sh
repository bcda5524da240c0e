#!/usr/bin/env bash
# One-step set-up: a virtual environment in .venv with vLLM (GPU build when nvidia-smi sees a GPU, the
# CPU build otherwise), tiktoken, numpy, matplotlib and pytest. Safe to re-run: it does nothing when
# the environment already matches the requirements file.
set -euo pipefail
cd "$(dirname "$0")"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  req=requirements.txt
else
  req=requirements-cpu.txt
fi
stamp=".venv/.installed-$(sha256sum "$req" | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "setup.sh: installing $req into .venv (a few minutes, ~4 GB)..." >&2
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "$req"
if [ "$req" = requirements-cpu.txt ]; then
  # The CPU build pulls CUDA builds of these; with CPU torch they fail at import and take
  # transformers (and so vLLM) down with them. vLLM's text path does not need them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import vllm, tiktoken, numpy, torch; print('setup.sh: ok, torch', torch.__version__, 'vllm', vllm.__version__)" >&2
touch "$stamp"
