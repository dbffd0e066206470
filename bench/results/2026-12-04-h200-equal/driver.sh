#!/usr/bin/env bash
# eaglet against speculators' native draft in equal GPU time, with the compiled run's evaluation through
# the training graphs (no no-grad compile after the last step).
# (1) `ec` (lr 1.2e-3, log_accept: the defaults at this width; 1,600 steps) alone on the GPU, empty compile
# cache: its training time gives N = 1600 x 241.9 / train_s (241.9 s: speculators' 1,600 steps alone,
# bench/results/2026-12-02-h200-versus). (2) side by side: `spec` (speculators 0.9.0 native, 1,600 steps),
# `eq` (ec's settings, N steps; seeds 0 and 1) and `eqh` (the same at lr 2.4e-3, seed 0); then the tree
# replays of spec and eq (seed 0), greedy and temperature 1, every prompt. Chain replays: k = 7.
# Run from $DEV/src by `dev_start` (bench/device.sh) after `dev_data` and `dev_target`.
source bench/device.sh
export TORCHINDUCTOR_CACHE_DIR=$DEV/ind-ab OMP_NUM_THREADS=2
A=(python3 bench/ab.py --work $DEV/W --target $DEV/G/smollm2 --data $DEV/D/sg7k.json --records 6000 --prompts 256
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1 --batch 256)
L=train.lr=0.0012,train.accept_loss=log_accept
ev() { echo "$(date +%s) $*" >> $DEV/L/events.txt; }
tr() { local n=$1 s=$2; shift 2; dev_job t-$n-s$s "${A[@]}" --seeds $s --variant "$@"; }
dec() { local d=$1; while [ ! -e $DEV/W/results/$d-s0.json ]; do sleep 5; done
  dev_job dec-$d "${A[@]}" --seeds 0 --variant $d --only $d --decode tree-replay:0 tree-replay:1 --decode-prompts 256; }
tr ec 0 ec:train.max_steps=1600,$L &
while [ ! -e $DEV/W/runs/ec-s0/ab-trained.json ]; do
  sleep 2; if ! kill -0 $! 2>/dev/null; then ev "ec stopped before its training was recorded"; break; fi; done
N=$(python3 -c "import json; print(int(1600 * 241.9 / json.load(open('$DEV/W/runs/ec-s0/ab-trained.json'))['train_s']))" \
    || echo 1600)
ev "eq steps $N"
tr spec 0 spec:trainer=speculators &
tr eq 0 eq:train.max_steps=$N,$L &
tr eq 1 eq:train.max_steps=$N,$L &
tr eqh 0 eqh:train.max_steps=$N,train.lr=0.0024,train.accept_loss=log_accept &
dec spec & dec eq &
wait
dev_job report "${A[@]}" --report
touch $DEV/L/ALLDONE
