#!/usr/bin/env bash
# GPU phases of the equal-time comparison (not part of the repo): 1 = stash part aa + data;
# 2 = target, wheels, start the driver (setsid) and wait; wait N = wait up to N s (or until done), collect.
set -uo pipefail
PH=$1
export PYTHONPATH=/tmp/site2:/tmp/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false EAGLET_CACHE=/tmp/cache
collect() {
  mkdir -p $OUT
  (cd /tmp/W 2>/dev/null && tar czf $OUT/res.tgz results decode ab.md ab.json side/side.json side-mt_bench/side.json 2>/dev/null)
  (cd /tmp/W/runs 2>/dev/null && tar czf $OUT/trainlogs.tgz */train/log.jsonl */train/manifest.json */train/speculators/train_log.jsonl */train/speculators/bench.json 2>/dev/null)
  (cd /tmp && tar czf $OUT/logs.tgz L/*.log 2>/dev/null)
  cp /tmp/W/ab.md $OUT/ 2>/dev/null
  tail -c 20000 /tmp/L/seq.log > $OUT/seq.tail 2>/dev/null
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv >> $OUT/smi.txt
  ls /tmp/W/results /tmp/W/decode 2>/dev/null; cat /tmp/W/ab.md 2>/dev/null; ls /tmp/L; tail -3 /tmp/L/*.log
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
  (cp .whl-vllm/smol/SHA256SUMS /tmp/P/ && cd /tmp/P && sha256sum -c --ignore-missing SHA256SUMS) || exit 3
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
   --sets heldout mt_bench --steps ${STEPS:-1600} --max-new-tokens 128 --k 7 --seeds 0)
L=train.lr=0.0012,train.accept_loss=log_accept
V=(--variant lr12lk:$L --variant spec:trainer=speculators --variant eq:time_of=spec,rate_of=lr12lk,$L)
"${A[@]}" "${V[@]}" > /tmp/L/seq.log 2>&1
touch /tmp/L/SEQDONE
"${A[@]}" --variant base --variant speclr12:trainer=speculators,train.lr=0.0012 > /tmp/L/more.log 2>&1 &
for m in tree:0 chain:1 tree:1; do for d in eq spec; do
  "${A[@]}" "${V[@]}" --only $d --decode $m --decode-prompts ${DP:-24} --decode-new-tokens ${DN:-96} > /tmp/L/dec-$d-${m/:/}.log 2>&1 &
done; done
wait
"${A[@]}" --report > /tmp/L/report.log 2>&1
touch /tmp/L/ALLDONE
DRV
  setsid nohup bash /tmp/L/driver.sh > /tmp/L/driver.log 2>&1 < /dev/null &
  waitdone ${WAIT:-470}; collect
  ;;
wait)
  waitdone $2; collect
  ;;
esac
