#!/usr/bin/env bash
# The device calls of this folder (run from the repository root on the device; bench/device.sh), each
# within 30 s of the last:
#   go.sh a       carried: .whl-vllm/smol/gguf.part-aa
#   go.sh b       carried: .whl-vllm/smol/gguf.part-ab, .whl (the wheels installed and imported here)
#   go.sh start   carried: .whl-vllm/ab, .whl-vllm/smol/{SHA256SUMS,gguf-*.whl}
#   go.sh wait N  collect after up to N s
set -uo pipefail
source bench/device.sh
case $1 in
a) dev_stash gguf.part-aa && ls -la $DEV/P && nvidia-smi --query-gpu=name,memory.used --format=csv ;;
b) dev_stash gguf.part-ab && dev_wheels .whl/*.whl && ls -la $DEV/P \
     && python3 -c "import speculators.models.eagle3, speculators.losses, speculators.config, speculators.proposals.greedy; print('speculators ok')" ;;
start) dev_data || exit $?; dev_target || exit $?; dev_start bench/results/2026-12-04-h200-equal/driver.sh
  dev_wait ${2:-480}; dev_collect ;;
wait) dev_wait $2; dev_collect ;;
esac
