#!/usr/bin/env bash
# Creates .venv-speculators: the third-party `speculators` package (vLLM's EAGLE-3 format)
# for tests/test_export.py, which loads eaglet's vLLM export with speculators' own loader and
# compares its logits with eaglet's. The default test suite runs that check only when this
# venv exists (it skips, saying why, otherwise).
#
# Why not `pip install speculators==0.9.0` with its declared dependencies: they pull torch
# 2.14.1 (a CUDA build, about 5.5 GB here), torchvision, torchaudio (no torchaudio matches
# torch 2.14.1 on this machine's indexes), datasets, openai, hs-connectors, ... none of which
# loading and running an Eagle3 draft imports (speculators imports them only in its CLI,
# data generation and training modules). So: speculators with --no-deps, plus what its
# model/config import path really needs: torch (the local 2.13.0 CPU wheel, the same torch
# as .venv), transformers in speculators' range (<=5.19.0; eaglet needs >=5.17), pydantic,
# loguru, huggingface-hub, safetensors.
#
# Usage: bash scripts/speculators_venv.sh    (EAGLET_TORCH overrides the torch requirement)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-speculators
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q)
python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" "${EAGLET_TORCH:-torch==2.13.0}"
fi
"${PIP[@]}" --no-deps "speculators==0.9.0"
# speculators' declared dependencies minus torch/torchvision/torchaudio ("import speculators"
# reaches openai, datasets and hs-connectors through speculators.train.data).
"${PIP[@]}" "hs-connectors==0.9.0" "transformers>=5.17,<=5.19.0" "datasets>=4.0.0,<=5.1.0" \
  "loguru>=0.7.2,<=0.7.3" "numpy>=2.0.0,<=2.5.4" "openai>=2.0.0" "pydantic>=2.0.0" \
  "pydantic-settings>=2.0.0" "tqdm>=4.66.3,<=4.70.1" "typer>=0.12.0" aiohttp click httpx \
  huggingface-hub protobuf psutil rich safetensors
"$VENV/bin/python" -c "import speculators, torch, transformers; print('speculators', speculators.__version__ if hasattr(speculators, '__version__') else '0.9.0', 'torch', torch.__version__, 'transformers', transformers.__version__)"
