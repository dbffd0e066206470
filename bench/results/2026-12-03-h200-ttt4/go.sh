#!/usr/bin/env bash
# The device calls of this folder (run from the repository root on the device; bench/device.sh):
#   go.sh stash   carried: .whl-vllm/ab, .whl-vllm/smol/gguf.part-aa
#   go.sh start   within 30 s; carried: .whl-vllm/smol/{gguf.part-ab,SHA256SUMS,gguf-*.whl}, .whl
#   go.sh wait N  collect after up to N s
set -uo pipefail
source bench/device.sh
case $1 in
stash) dev_data && dev_stash gguf.part-aa && ls -la $DEV/P $DEV/D ;;
start) dev_target || exit $?; dev_start bench/results/2026-12-03-h200-ttt4/driver.sh; dev_wait ${2:-480}; dev_collect ;;
wait) dev_wait $2; dev_collect ;;
esac
