#!/usr/bin/env bash
# The device calls of this folder (run from the repository root on the device; bench/device.sh), each
# within 30 s of the last:
#   go.sh probe   carried: .whl-vllm/smol/gguf.part-aa. The trainer at SmolLM2's width on a random target
#                 (bench/small_trainer.py, online states): the target in its own process (extract.online_ahead,
#                 the GPU default) against the target in the trainer's process, 150 steps each
#   go.sh b       carried: .whl-vllm/smol/gguf.part-ab, .whl
#   go.sh start   carried: .whl-vllm/ab, .whl-vllm/smol/{SHA256SUMS,gguf-*.whl}
#   go.sh wait N  collect after up to N s
set -uo pipefail
source bench/device.sh
HERE=bench/results/2026-12-04-h200-ahead
case $1 in
probe) dev_stash gguf.part-aa; mkdir -p $OUT
  for a in 2 0; do
    PYTHONPATH=$PWD:$PYTHONPATH TORCHINDUCTOR_CACHE_DIR=$DEV/ind-probe-$a python3 bench/small_trainer.py \
      --out $DEV/st$a --mode online --steps 150 --log-every 25 --set extract.online_ahead=$a > $OUT/small-ahead$a.log 2>&1
    echo "ahead $a rc $?"; cp $DEV/st$a/small-online.json $OUT/small-ahead$a.json 2>/dev/null
    grep -h "small\]\|Error\|error" $OUT/small-ahead$a.log | tail -4 | cut -c1-400
  done
  nvidia-smi --query-gpu=name,memory.used --format=csv ;;
b) dev_stash gguf.part-ab && dev_wheels .whl/*.whl && ls -la $DEV/P \
     && python3 -c "import speculators.models.eagle3, speculators.losses, speculators.config, speculators.proposals.greedy; print('speculators ok')" ;;
start) dev_data || exit $?; dev_target || exit $?; dev_start $HERE/driver.sh
  dev_wait ${2:-480}; dev_collect ;;
wait) dev_wait $2; dev_collect ;;
esac
