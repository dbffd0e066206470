#!/usr/bin/env bash
# eaglet against speculators' native draft in equal GPU time on one GPU, SmolLM2-135M-Instruct and the first
# 6,000 of 7,000 ShareGPT records (docs/quality.md), each training alone on the GPU from an empty compile cache:
#   ec    eaglet's defaults at this width, EC_STEPS steps (default 600): the calibration of eaglet's rate
#   spec  speculators 0.9.0's own model, TTT, loss, mask and initialisation, 1,600 steps
#   eq    eaglet's defaults for the steps that fit spec's time at ec's rate (ab.py time_of=spec,rate_of=ec:
#         ec's fixed costs once, then its seconds a step), seed 0; then seed 1 at the same steps, beside the
#         tree replays (EAGLE-2 10/6/60, greedy and temperature 1) of spec and eq seed 0
# Every draft is also replayed as a chain of 7, greedy and at temperature 1, on 256 held-out prompts and the
# 80 MT-bench questions. On a device: `bash bench/device_go.sh a`, `... b`, `... start bench/equal_time.sh`, then
# `... wait 560` until it is done (each call within 30 s of the last; bench/device_go.sh says what each carries).
# Time on an H200 whose host ran the A/B's 1,600 eaglet steps in 246 s: ec ~110 s, the target's side of the
# replays ~190 s (once), spec ~300-450 s, eq about spec's, the trees ~120 s: 20-25 minutes with the payload.
# A check of this script on a CPU before a device call (a few minutes; the results mean nothing):
#   DEV=/tmp/ets PY=.venv-speculators/bin/python TARGET=~/.cache/eaglet/smollm2-135m-instruct \
#   DATA=~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json RECORDS=150 PROMPTS=3 STEPS=4 EC_STEPS=3 \
#   NEW_TOKENS=8 SETS="--set train.max_tokens=512 --set prepare.max_length=256 --set vocab.size=4096 \
#   --set target.dtype=float32 --set extract.online_ahead=2" bash bench/equal_time.sh
source bench/device.sh
export OMP_NUM_THREADS=2
mkdir -p $DEV/L
# SETS: extra --set arguments for every draft (word-split on purpose)
# shellcheck disable=SC2206
AB=(${PY:-python3} bench/ab.py --work $DEV/W --target ${TARGET:-$DEV/G/smollm2} --data ${DATA:-$DEV/D/sg7k.json}
    --records ${RECORDS:-6000} --prompts ${PROMPTS:-256} --sets heldout mt_bench --steps ${STEPS:-1600}
    --max-new-tokens ${NEW_TOKENS:-128} --k 7 --replay-temperature 1 --batch 256 ${SETS:-})
TREE_PROMPTS=${PROMPTS:-256} TREE_NEW_TOKENS=${NEW_TOKENS:-128}
L=train.lr=0.0012,train.accept_loss=log_accept
dev_ab_train ec 0 ec:train.max_steps=${EC_STEPS:-600},$L
dev_ab_train spec 0 spec:trainer=speculators
dev_ab_train eq 0 eq:time_of=spec,rate_of=ec,$L
N=$(python3 -c "import json; print(json.load(open('$DEV/W/results/eq-s0.json'))['train']['steps'])") || N=0
echo "$(date +%s) eq steps $N" >> $DEV/L/events.txt
if [ "$N" -gt 0 ]; then dev_ab_train eq 1 eq:train.max_steps=$N,$L & fi
dev_ab_tree spec & dev_ab_tree eq &
wait
dev_job report "${AB[@]}" --report
touch $DEV/L/ALLDONE
