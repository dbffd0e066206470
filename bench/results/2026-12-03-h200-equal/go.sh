#!/usr/bin/env bash
# Equal GPU time, re-measured after the warm-up fixes, with temperature-1 and tree replays.
# start = assemble the target (GGUF part aa stashed by the call before, part ab carried), install the wheels,
# start the driver (setsid) and wait; wait N = wait up to N s, collect.
# The driver: (1) `ec`, eaglet's draft (lr 1.2e-3, log_accept) for speculators' 1,600 steps, alone on the GPU
# with an empty compile cache: its training time, compile included, gives N = 1600 x 241.9 / train_s, the
# steps eaglet makes in speculators' 241.9 s (2026-12-02-h200-versus, alone). (2) side by side: `spec`
# (speculators' native draft, 1,600 steps) seed 0 and `eqc` (ec's settings, N steps) seeds 0 and 1; then the
# tree replays of spec and eqc, greedy and temperature 1, every prompt.
# As run: `WAIT=470 go.sh start`, then `go.sh wait 540` and `go.sh wait 50`. ec trained in 264.5 s, so eqc had
# 1,463 steps. The target sides (made once, after ec's training) took 178 s. The tree replays were still in
# progress when the device time ran out, with no result written: replay_tree ran prompt by prompt, and
# eqc's had not finished its first 256 prompts in about 340 s.
set -uo pipefail
PH=$1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=/tmp/site2:/tmp/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLET_CACHE=/tmp/cache OMP_NUM_THREADS=2
collect() {
  mkdir -p $OUT
  (cd /tmp/W 2>/dev/null && tar czf $OUT/res.tgz results decode ab.md ab.json 2>/dev/null)
  (cd /tmp/W/runs 2>/dev/null && tar czf $OUT/trainlogs.tgz */train/log.jsonl */train/manifest.json */train/speculators/train_log.jsonl 2>/dev/null)
  (cd /tmp && tar czf $OUT/logs.tgz L/*.log L/*.txt 2>/dev/null)
  ls /tmp/W/results /tmp/W/decode 2>/dev/null; cat /tmp/L/events.txt; for f in /tmp/L/*.log; do echo "== $f"; tail -2 $f | cut -c1-300; done
  cat /tmp/W/ab.md 2>/dev/null
}
waitdone() { local t=0; while [ $t -lt $1 ] && [ ! -e /tmp/L/ALLDONE ]; do sleep 5; t=$((t+5)); done; }
case $PH in
start)
  mv .whl-vllm/smol/gguf.part-ab /tmp/P/
  (cp .whl-vllm/smol/SHA256SUMS /tmp/P/ && cd /tmp/P && sha256sum -c SHA256SUMS) || exit 3
  pip install --no-index --no-deps --target /tmp/site2 .whl-vllm/smol/gguf-0.19.0-py3-none-any.whl .whl/*.whl -q || exit 5
  rm -rf /tmp/src && mkdir -p /tmp/src /tmp/L && cp -r eaglet bench /tmp/src/
  python3 -c "import speculators.models.eagle3, speculators.losses; print('speculators ok')" || exit 6
  mkdir -p /tmp/G && cat /tmp/P/gguf.part-aa /tmp/P/gguf.part-ab > /tmp/G/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "
from pathlib import Path
from eaglet.demo import gguf_to_folder
print(gguf_to_folder(Path('/tmp/G/SmolLM2-135M-Instruct.Q4_1.gguf'), Path('/tmp/G/smollm2')))" || exit 4
  cat > /tmp/L/driver.sh <<'DRV'
cd /tmp/src
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-ab
A=(python3 bench/ab.py --work /tmp/W --target /tmp/G/smollm2 --data /tmp/D/sg7k.json --records 6000 --prompts 256
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1)
L=train.lr=0.0012,train.accept_loss=log_accept
tr() { local n=$1 s=$2 rc; shift 2; "${A[@]}" --seeds $s --variant "$@" > /tmp/L/t-$n-s$s.log 2>&1; rc=$?; echo "$(date +%s) trained $n s$s rc $rc" >> /tmp/L/events.txt; }
dec() { local d=$1; while [ ! -e /tmp/W/results/$d-s0.json ]; do sleep 5; done
  "${A[@]}" --seeds 0 --variant $d --only $d --decode tree-replay:0 tree-replay:1 --decode-prompts 256 > /tmp/L/dec-$d.log 2>&1
  local rc=$?; echo "$(date +%s) decoded $d rc $rc" >> /tmp/L/events.txt; }
echo "$(date +%s) start" >> /tmp/L/events.txt
tr ec 0 ec:train.max_steps=1600,$L
N=$(python3 -c "import json; print(int(1600 * 241.9 / json.load(open('/tmp/W/results/ec-s0.json'))['train']['train_s']))" || echo 1376)
echo "$(date +%s) eqc steps $N" >> /tmp/L/events.txt
tr spec 0 spec:trainer=speculators &
tr eqc 0 eqc:train.max_steps=$N,$L &
tr eqc 1 eqc:train.max_steps=$N,$L &
dec spec & dec eqc &
wait
"${A[@]}" --report > /tmp/L/report.log 2>&1
touch /tmp/L/ALLDONE
DRV
  setsid nohup bash /tmp/L/driver.sh > /tmp/L/driver.log 2>&1 < /dev/null &
  waitdone ${WAIT:-480}; collect
  ;;
wait)
  waitdone $2; collect
  ;;
esac
