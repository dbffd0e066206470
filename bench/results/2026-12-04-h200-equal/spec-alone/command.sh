#!/usr/bin/env bash
# The device call that made this folder, right after driver.sh's ALLDONE on the same machine (its
# $DEV/W, nothing else running): speculators' native draft, seed 1, alone from an empty compile cache,
# until its training time is recorded (ab-trained.json; its replays were cut off by the call's end).
source bench/device.sh; cd $DEV/src; export TORCHINDUCTOR_CACHE_DIR=$DEV/ind-spec1 OMP_NUM_THREADS=2
(setsid nohup python3 bench/ab.py --work $DEV/W --target $DEV/G/smollm2 --data $DEV/D/sg7k.json --records 6000 \
    --prompts 256 --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1 --batch 256 \
    --seeds 1 --variant spec:trainer=speculators > $DEV/L/t-spec-s1-alone.log 2>&1 &)
t=0; while [ $t -lt 400 ] && [ ! -e $DEV/W/runs/spec-s1/ab-trained.json ]; do sleep 3; t=$((t+3)); done
mkdir -p $OUT; cp $DEV/W/runs/spec-s1/ab-trained.json $DEV/L/t-spec-s1-alone.log $OUT/
cp $DEV/W/runs/spec-s1/train/speculators/train_log.jsonl $OUT/
