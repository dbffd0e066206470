#!/usr/bin/env bash
# Equal GPU time with a 4-step TTT unroll: the A/B's draft step at TTT 4 took 43.5 ms against 64.2 ms at TTT 7
# (bench/results/2026-12-03-h200-small), so in speculators' 241.9 s eaglet makes more steps.
# (1) `e4` (lr 1.2e-3, log_accept, train.ttt_steps=4, 1,600 steps) alone on the GPU, empty compile cache: its
# training time gives N = 1600 x 241.9 / train_s. (2) side by side: `spec` (speculators 0.9.0 native, TTT 7,
# 1,600 steps, seed 0), `eq4` (e4's settings, N steps) and `eq4l` (the same at lr 2.4e-3); then the tree replays
# of spec and eq4, greedy and temperature 1, every prompt. Replays: chain of 7 (bench/ab.py --k 7).
# Run from $DEV/src by `dev_start` (bench/device.sh) after `dev_data` and `dev_target`.
source bench/device.sh
export TORCHINDUCTOR_CACHE_DIR=$DEV/ind-ab OMP_NUM_THREADS=2
A=(python3 bench/ab.py --work $DEV/W --target $DEV/G/smollm2 --data $DEV/D/sg7k.json --records 6000 --prompts 256
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1)
L=train.accept_loss=log_accept,train.ttt_steps=4
ev() { echo "$(date +%s) $*" >> $DEV/L/events.txt; }
tr() { local n=$1 s=$2; shift 2; dev_job t-$n-s$s "${A[@]}" --seeds $s --variant "$@"; }
dec() { local d=$1; while [ ! -e $DEV/W/results/$d-s0.json ]; do sleep 5; done
  dev_job dec-$d "${A[@]}" --seeds 0 --variant $d --only $d --decode tree-replay:0 tree-replay:1 --decode-prompts 256; }
tr e4 0 e4:train.max_steps=1600,train.lr=0.0012,$L &
while [ ! -e $DEV/W/runs/e4-s0/ab-trained.json ]; do
  sleep 2; if ! kill -0 $! 2>/dev/null; then ev "e4 stopped before its training was recorded"; break; fi; done
N=$(python3 -c "import json; print(int(1600 * 241.9 / json.load(open('$DEV/W/runs/e4-s0/ab-trained.json'))['train_s']))" \
    || echo 1600)
ev "eq4 steps $N"
tr spec 0 spec:trainer=speculators &
tr eq4 0 eq4:train.max_steps=$N,train.lr=0.0012,$L &
tr eq4l 0 eq4l:train.max_steps=$N,train.lr=0.0024,$L &
dec spec & dec eq4 &
wait
dev_job report "${A[@]}" --report
touch $DEV/L/ALLDONE
