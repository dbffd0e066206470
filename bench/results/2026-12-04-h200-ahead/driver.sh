#!/usr/bin/env bash
# eaglet against speculators' native draft in equal GPU time, with the target's forward in a process of its
# own (extract.online_ahead, the GPU default). Each training alone on the GPU, every one from an empty compile
# cache: (1) `ec`, eaglet's defaults at this width (lr 1.2e-3 from auto, log_accept), 1,600 steps; (2) `spec`,
# speculators 0.9.0 native, 1,600 steps; (3) `eq`, ec's settings for as many steps as ec's rate runs in spec's
# time (ab.py's time_of=spec,rate_of=ec; seed 0). Then, together: `eq` seed 1 at the same steps, and the tree
# replays of spec and eq seed 0, greedy and temperature 1, every prompt. Chain replays: k = 7.
# Run from $DEV/src by `dev_start` (bench/device.sh) after `dev_data` and `dev_target`.
source bench/device.sh
export OMP_NUM_THREADS=2
A=(python3 bench/ab.py --work $DEV/W --target $DEV/G/smollm2 --data $DEV/D/sg7k.json --records 6000 --prompts 256
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1 --batch 256)
L=train.lr=0.0012,train.accept_loss=log_accept
ev() { echo "$(date +%s) $*" >> $DEV/L/events.txt; }
tr() { local n=$1 s=$2; shift 2; TORCHINDUCTOR_CACHE_DIR=$DEV/ind-$n-s$s dev_job t-$n-s$s "${A[@]}" --seeds $s --variant "$@"; }
dec() { local d=$1; TORCHINDUCTOR_CACHE_DIR=$DEV/ind-dec dev_job dec-$d "${A[@]}" --seeds 0 --variant $d --only $d \
  --decode tree-replay:0 tree-replay:1 --decode-prompts 256; }
tr ec 0 ec:train.max_steps=1600,$L
tr spec 0 spec:trainer=speculators
tr eq 0 eq:time_of=spec,rate_of=ec,$L
N=$(python3 -c "import json; print(json.load(open('$DEV/W/results/eq-s0.json'))['train']['steps'])") || N=0
ev "eq steps $N"
if [ "$N" -gt 0 ]; then tr eq 1 eq:train.max_steps=$N,$L & fi
dec spec & dec eq &
wait
dev_job report "${A[@]}" --report
touch $DEV/L/ALLDONE
