#!/usr/bin/env bash
# The draft measured inside vLLM against eaglet's own eval, on one GPU:
#   bash bench/engine_eval.sh PHASE WORK TARGET DATA [STEPS]
# PHASE train: prepare, online extract, vocab, train (STEPS, default 1200) and export a draft of
#   TARGET on DATA (a chat dataset file) into WORK/run;
# PHASE prepare: prepare alone (for an eval of a draft from elsewhere, EVAL_SETS="--set eval.draft=DIR");
# PHASE heldout: `eaglet eval` of that draft on 32 held-out prompts, in process and in vLLM
#   (eval.vllm=on: acceptance, speed at batch 1 and 16, greedy identity, agreement);
# PHASE mt_bench: the vLLM eval alone (eval.in_process=false) on the 80 MT-bench questions.
# The in-process eval of MT-bench, a CPU's work, is the same command with eval.in_process=true
# and eval.vllm=off. Extra settings for every phase: EVAL_SETS (environment), e.g.
# "--set eval.max_new_tokens=256". Settings for every phase that decide the draft (its type):
# TYPE_SETS, e.g. "--set train.algorithm=dflash --set extract.draft_types=[dflash]".
# Logs go to WORK/logs/PHASE.log.
set -uo pipefail
PHASE=$1; W=$2; T=$3; D=$4; STEPS=${5:-1200}
cd "$(dirname "$0")/.."
mkdir -p "$W/logs"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
S=(--set "run.dir=$W/run" --set "target.path=$T" --set "prepare.data=[$D]"
   --set prepare.max_length=2048 --set prepare.num_workers=12 --set target.dtype=bfloat16
   --set extract.mode=online --set extract.selfcheck_samples=8 --set vocab.size=32000
   --set train.max_tokens=8192 --set train.ttt_steps=7 --set train.lr=0.0003 --set train.warmup_steps=100
   --set "train.max_steps=$STEPS" --set train.epochs=1000 --set train.log_every=50 --set train.eval_every=0
   --set train.ckpt_every=400 --set train.eval_fraction=0.02 --set train.tensorboard=false
   --set export.speculative_tokens=3 --set eval.chain_tokens=3 --set eval.max_new_tokens=128
   --set "eval.vllm_engine_args={gpu_memory_utilization: 0.45}")
E=(${EVAL_SETS:-})
S+=(${TYPE_SETS:-})
C="$W/config.yaml"; [ -f "$C" ] || echo "{}" > "$C"  # every setting is given here
case $PHASE in
  prepare) python3 -m eaglet.cli prepare "$C" "${S[@]}" ;;
  train) python3 -m eaglet.cli run "$C" --until export "${S[@]}" ;;
  heldout) python3 -m eaglet.cli eval "$C" "${S[@]}" --set eval.vllm=on --set eval.num_prompts=32 "${E[@]}" ;;
  mt_bench) python3 -m eaglet.cli eval "$C" "${S[@]}" --set eval.vllm=on --set eval.in_process=false \
              --set eval.prompts=mt_bench --set eval.num_prompts=80 "${E[@]}" ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac 2>&1 | tee "$W/logs/$PHASE.log"
exit "${PIPESTATUS[0]}"
