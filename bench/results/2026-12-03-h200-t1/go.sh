#!/usr/bin/env bash
# GPU phases: start = assemble the target (GGUF part aa stashed by the warm-up call, part ab carried), install
# the wheels, start the driver (setsid) and wait; wait N = wait up to N s, collect.
# Changed after the run: events.txt recorded "rc 0" for every job (`$?` was read after `$(date)`),
# so the two speculators drafts, whose replay ran out of memory after training, showed as done;
# and the CUDA allocator's expandable segments are now on (two eaglet trainings held 48 and 74 GiB).
# As run, `WAIT=540 go.sh start` outlasted the call's 590 s with its setup, so it never collected;
# the default wait is now 450 s.
set -uo pipefail
PH=$1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=/tmp/site2:/tmp/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLET_CACHE=/tmp/cache OMP_NUM_THREADS=2
collect() {
  mkdir -p $OUT
  (cd /tmp/W 2>/dev/null && tar czf $OUT/res.tgz results decode ab.md ab.json 2>/dev/null)
  (cd /tmp/W/runs 2>/dev/null && tar czf $OUT/trainlogs.tgz */train/log.jsonl */train/manifest.json */train/speculators/train_log.jsonl 2>/dev/null)
  (cd /tmp && tar czf $OUT/logs.tgz L/*.log L/*.txt 2>/dev/null)
  ls /tmp/W/results /tmp/W/decode 2>/dev/null; cat /tmp/L/events.txt; for f in /tmp/L/*.log; do echo "== $f"; tail -2 $f | cut -c1-300; done
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
A=(python3 bench/ab.py --work /tmp/W --target /tmp/G/smollm2 --data /tmp/D/sg7k.json --records 6000 --prompts 256
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7 --replay-temperature 1)
L=train.lr=0.0012,train.accept_loss=log_accept
tr() { local n=$1 s=$2 rc; shift 2; "${A[@]}" --seeds $s --variant "$@" > /tmp/L/t-$n-s$s.log 2>&1; rc=$?; echo "$(date +%s) trained $n s$s rc $rc" >> /tmp/L/events.txt; }
dec() { local d=$1; while [ ! -e /tmp/W/results/$d-s0.json ]; do sleep 5; done
  "${A[@]}" --seeds 0 --variant $d --only $d --decode tree-replay:0 tree-replay:1 --decode-prompts 256 > /tmp/L/dec-$d.log 2>&1
  local rc=$?; echo "$(date +%s) decoded $d rc $rc" >> /tmp/L/events.txt; }
echo "$(date +%s) start" >> /tmp/L/events.txt
tr spec 0 spec:trainer=speculators &
sleep 20
tr eq 0 eq:train.max_steps=1376,$L &
tr spec 1 spec:trainer=speculators &
tr eq 1 eq:train.max_steps=1376,$L &
dec spec & dec eq &
wait
"${A[@]}" --report > /tmp/L/report.log 2>&1
touch /tmp/L/ALLDONE
DRV
  setsid nohup bash /tmp/L/driver.sh > /tmp/L/driver.log 2>&1 < /dev/null &
  waitdone ${WAIT:-450}; collect
  ;;
wait)
  waitdone $2; collect
  ;;
esac
