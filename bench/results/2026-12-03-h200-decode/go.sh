#!/usr/bin/env bash
# GPU phases (not part of the repo): 1 = stash part aa + data; 2 = target, wheels, start the driver (setsid), wait;
# wait N = wait up to N s (or until done), collect.
set -uo pipefail
# As run: after phase 2 the GPU's memory was full (seven trainings), so the next call killed
# speclr12-s0, spec-s1, eq-s1 and base-s0 (pkill -f on their run folders) and only waited; the
# eqw decodes ran as the driver started them. A last call then trained base-s0 and eq-s1 again
# (and spec-s1, which did not finish before the device time ran out), each as
# `python3 bench/ab.py <A's arguments> --seeds S --variant V` in its own process.
PH=$1
export PYTHONPATH=/tmp/site2:/tmp/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLET_CACHE=/tmp/cache OMP_NUM_THREADS=2
collect() {
  mkdir -p $OUT
  (cd /tmp/W 2>/dev/null && tar czf $OUT/res.tgz results decode ab.md ab.json side/side.json side-mt_bench/side.json 2>/dev/null)
  (cd /tmp/W/runs 2>/dev/null && tar czf $OUT/trainlogs.tgz */train/log.jsonl */train/manifest.json */train/speculators/train_log.jsonl */train/speculators/bench.json 2>/dev/null)
  (cd /tmp && tar czf $OUT/logs.tgz L/*.log L/*.txt 2>/dev/null)
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv >> /tmp/L/smi.txt; cp /tmp/L/smi.txt $OUT/
  ls /tmp/W/results /tmp/W/decode 2>/dev/null; ls /tmp/L; for f in /tmp/L/*.log; do echo "== $f"; tail -2 $f | cut -c1-300; done
}
waitdone() { local t=0; while [ $t -lt $1 ] && [ ! -e /tmp/L/ALLDONE ]; do sleep 5; t=$((t+5)); done; }
case $PH in
1)
  mkdir -p /tmp/P /tmp/D /tmp/cache
  mv .whl-vllm/smol/gguf.part-aa /tmp/P/
  xz -dc .whl-vllm/ab/sharegpt7k.json.xz > /tmp/D/sg7k.json
  cp .whl-vllm/ab/mt_bench_question.jsonl /tmp/cache/
  (cd .whl-vllm/ab && sha256sum -c SHA256SUMS)
  ls -la /tmp/P /tmp/D /tmp/cache; nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  ;;
2)
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
   --sets heldout mt_bench --steps 1600 --max-new-tokens 128 --k 7)
L=train.lr=0.0012,train.accept_loss=log_accept
tr() { local n=$1 s=$2; shift 2; "${A[@]}" --seeds $s --variant "$@" > /tmp/L/t-$n-s$s.log 2>&1; echo "$(date +%s) trained $n s$s rc $?" >> /tmp/L/events.txt; }
dec() { local d=$1 m=$2; while [ ! -e /tmp/W/results/$d-s0.json ]; do sleep 5; done
  "${A[@]}" --seeds 0 --variant $d --only $d --decode $m --decode-prompts ${DP:-16} --decode-new-tokens ${DN:-96} > /tmp/L/dec-$d-${m/:/}.log 2>&1
  echo "$(date +%s) decoded $d $m rc $?" >> /tmp/L/events.txt; }
echo "$(date +%s) start" >> /tmp/L/events.txt
tr eq 0 eq:train.max_steps=1376,$L &
sleep 15
tr spec 0 spec:trainer=speculators &
tr speclr12 0 speclr12:trainer=speculators,train.lr=0.0012 &
for d in eq spec eqw; do for m in tree:0 chain:1 tree:1; do dec $d $m & done; done
t=0; until [ "$(wc -l < /tmp/W/runs/eq-s0/train/log.jsonl 2>/dev/null || echo 0)" -ge 2 ] || [ $t -ge 400 ]; do sleep 5; t=$((t+5)); done
echo "$(date +%s) eq compiled" >> /tmp/L/events.txt
tr eqw 0 eqw:train.max_steps=2184,$L &
tr base 0 base &
tr spec 1 spec:trainer=speculators &
tr eq 1 eq:train.max_steps=1376,$L &
wait
"${A[@]}" --report > /tmp/L/report.log 2>&1
touch /tmp/L/ALLDONE
DRV
  setsid nohup bash -c "while true; do nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader >> /tmp/L/smi.txt; sleep 30; done" > /dev/null 2>&1 < /dev/null &
  setsid nohup bash /tmp/L/driver.sh > /tmp/L/driver.log 2>&1 < /dev/null &
  waitdone ${WAIT:-420}; collect
  ;;
wait)
  waitdone $2; collect
  ;;
esac
