#!/usr/bin/env bash
# The device calls that run a driver (bench/equal_time.sh, a results folder's driver.sh) on one GPU, from the
# repository root there (the `device` tool's `run`), each within 30 s of the last (the machine keeps /tmp):
#   bash bench/device_go.sh a            carry: .whl-vllm/smol/gguf.part-aa
#   bash bench/device_go.sh b            carry: .whl-vllm/smol/gguf.part-ab, .whl (speculators' wheels, imported)
#   bash bench/device_go.sh start DRIVER carry: .whl-vllm/ab, .whl-vllm/smol/SHA256SUMS, .whl-vllm/smol/gguf-*.whl
#                                        (the data and target set up, DRIVER started; returns after 420 s at most)
#   bash bench/device_go.sh wait N       until the driver is done or N s (at most 560), then what it made to $OUT
# A call carries at most 64 MiB with the tree, hence three; bench/device_payload.sh builds what they carry.
# `a` and `b` start on a fresh machine: if `b` says the machine was not warm, carry part-aa again with `b`'s call.
set -uo pipefail
source bench/device.sh
case ${1:-} in
a) dev_stash gguf.part-aa && ls -la $DEV/P && nvidia-smi --query-gpu=name,memory.used --format=csv ;;
b) dev_stash gguf.part-aa; dev_stash gguf.part-ab && dev_wheels .whl/*.whl && ls -la $DEV/P \
     && python3 -c "import speculators.models.eagle3, speculators.losses; print('speculators ok')" ;;
start) [ -f "${2:-}" ] || { echo "start: no driver ${2:-}"; exit 2; }
  dev_data || exit $?; dev_target || exit $?; dev_start "$2"; dev_wait 420; dev_collect ;;
wait) dev_wait "${2:-560}"; dev_collect ;;
*) echo "usage: bench/device_go.sh a | b | start DRIVER | wait N"; exit 2 ;;
esac
