#!/usr/bin/env bash
# Creates .venv-speculators: the third-party `speculators` 0.9.0 package (vLLM's EAGLE-3
# format) for tests/test_export.py, which loads eaglet's vLLM export with speculators' own
# loader and compares its logits with eaglet's. The default test suite runs that check when
# this venv exists and skips it, saying why, when it does not.
#
# A plain `pip install speculators==0.9.0` resolves here to 89 packages: torch 2.14.1 (the
# CUDA build from local disk, with its nvidia-* libraries, ~5.5 GB), torchvision 0.29.1 and
# torchaudio 2.11.1 from PyPI (built for torch 2.11, not 2.14). Loading and running an Eagle3
# draft imports neither torchvision nor torchaudio, and runs on the torch 2.13 .venv has. So: every other declared dependency (`import speculators`
# reaches openai, datasets and hs-connectors through speculators.train.data), transformers
# inside speculators' range (<=5.19.0; eaglet needs >=5.17), then speculators with --no-deps.
# torch: reused from .venv through a .pth file (this venv's own packages come first on
# sys.path, so its transformers 5.19 shadows .venv's); without a usable .venv (run
# scripts/setup.sh first) the local torch==2.13.0 CPU wheel is installed here instead.
# Measured on the 2-core dev machine: ~65 s and ~0.3 GB reusing .venv's torch; ~135 s and
# ~1.5 GB standalone.
#
# Usage: bash scripts/speculators_venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-speculators
BASE=.venv
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q)
pyver() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

rm -rf "$VENV"
python3 -m venv "$VENV"
if [ -x "$BASE/bin/python" ] && "$BASE/bin/python" -c "import torch" 2>/dev/null \
    && [ "$(pyver "$BASE/bin/python")" = "$(pyver "$VENV/bin/python")" ]; then
  echo "[speculators_venv] reusing torch from $BASE"
  purelib "$(pwd)/$BASE/bin/python" > "$(purelib "$VENV/bin/python")/zz-eaglet-base-venv.pth"
else
  echo "[speculators_venv] no usable $BASE: installing torch==2.13.0 here"
  "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" "hs-connectors==0.9.0" "transformers>=5.17,<=5.19.0" "datasets>=4.0.0,<=5.1.0" \
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" "pydantic>=2.0.0" \
  "pydantic-settings>=2.0.0" "tqdm>=4.66.3,<=4.70.1" "typer>=0.12.0" aiohttp click httpx \
  huggingface-hub protobuf psutil rich safetensors pyyaml
"${PIP[@]}" --no-deps "speculators==0.9.0"
"${PIP[@]}" --no-deps -e .
"$VENV/bin/python" -c "
import importlib.metadata as md, torch, transformers, speculators.models, eaglet.formats.serving
print('[speculators_venv] speculators', md.version('speculators'), 'torch', torch.__version__,
      'transformers', transformers.__version__)"
