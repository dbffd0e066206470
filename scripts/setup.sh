#!/usr/bin/env bash
# Creates .venv and installs eaglet into it (editable, with test tools).
# torch: a machine with no torch in .venv gets $EAGLET_TORCH (default: torch==2.13.0, the CPU
# build these machines carry on local disk); on a GPU machine set EAGLET_TORCH to the CUDA
# build you want, or create .venv yourself with torch already in it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "${EAGLET_TORCH:-torch==2.13.0}"
fi
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
