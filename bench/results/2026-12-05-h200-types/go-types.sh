#!/usr/bin/env bash
# The draft types side by side on one H200 (docs/draft-types.md): SmolLM2-135M-Instruct and the demo's
# ShareGPT file, one prepared data set per type (the same records), each type trained for STEPS steps from
# the target's states computed online, then measured in process and in vLLM (bench/engine_eval.sh):
# held-out (tau, vLLM's mean acceptance length, output tokens/s at batch 1 and 16 against no draft) and
# MT-bench in vLLM. Each train log gives its seconds, so the GPU time of each type is on record.
# Needs the target converted and vLLM installed (bench/device.sh: dev_data, dev_target, dev_vllm after
# carrying bench/vllm_payload.sh's parts). Run on a device as a background driver:
#   source bench/device.sh && dev_start bench/results/2026-12-05-h200-types/go-types.sh
# Not run yet: no device was lent when it was written.
source bench/device.sh
STEPS=${STEPS:-1200}
for t in ${TYPES:-eagle3 dflash peagle}; do
  W=$DEV/T/$t
  export TYPE_SETS="--set train.algorithm=$t --set extract.draft_types=[dflash] --set dflash.block_size=8"
  dev_job "$t-train" bash bench/engine_eval.sh train "$W" "$DEV/G/smollm2" "$DEV/D/sg7k.json" "$STEPS"
  dev_job "$t-heldout" bash bench/engine_eval.sh heldout "$W" "$DEV/G/smollm2" "$DEV/D/sg7k.json"
  EVAL_SETS="--set eval.vllm_batch_sizes=[1,16]" \
    dev_job "$t-mt_bench" bash bench/engine_eval.sh mt_bench "$W" "$DEV/G/smollm2" "$DEV/D/sg7k.json"
done
touch "$DEV/L/ALLDONE"
