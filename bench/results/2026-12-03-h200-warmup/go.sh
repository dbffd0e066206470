#!/usr/bin/env bash
# One device call on a fresh H200 (empty compile caches), the parts one after another:
#   fw     bench/fullwidth.py: `eaglet run` (doctor, prepare, extract, vocab, train) at DeepSeek-V3 width,
#          4,000 synthetic conversations, 200 training steps of up to 4,096 tokens, draft vocabulary 32k
#   dsv3   bench/train_throughput.py at the same draft shape (preset deepseek-v3), 16 packed micro-batches
#          of 4,096 tokens, the loss share of fullwidth's data (0.44) and the in-vocabulary share of a
#          random target's teacher over a 32k draft vocabulary of 129,280 (0.25)
#   e8v    bash bench/perf.sh at 8B dims on 16 varying packed micro-batches (e8v: marked; e8va: default)
# Also stashes the target's first GGUF part (/tmp/P) and the A/B's data (/tmp/D) for the next call.
# Changed after the run: each part has its own inductor cache (the bench ran on the fullwidth run's,
# so its compile was not cold), and fullwidth.py now logs every 10 steps (it was set to every step).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
mkdir -p /tmp/P "$OUT"
mkdir -p /tmp/D /tmp/cache
[ -e .whl-vllm/smol/gguf.part-aa ] && mv .whl-vllm/smol/gguf.part-aa /tmp/P/
(cd .whl-vllm/ab && sha256sum -c SHA256SUMS) && xz -dc .whl-vllm/ab/sharegpt7k.json.xz > /tmp/D/sg7k.json
cp .whl-vllm/ab/mt_bench_question.jsonl /tmp/cache/
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
git log -1 --format=%h 2>/dev/null
t0=$(date +%s)
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-fw timeout 290 python3 bench/fullwidth.py --out /tmp/fw --conversations 4000 --steps 200 --set vocab.size=32000 \
  --set extract.selfcheck_min_cosine=0.98 --set extract.selfcheck_min_top1=0.80 > "$OUT/fw.log" 2>&1
echo "fw rc $? in $(($(date +%s) - t0)) s"; tail -3 "$OUT/fw.log" | cut -c1-400
cp /tmp/fw/fullwidth.json /tmp/fw/run/train/log.jsonl /tmp/fw/run/train/manifest.json "$OUT/" 2>/dev/null
rm -rf /tmp/fw/run/extract
t1=$(date +%s)
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-dsv3 timeout 150 python3 bench/train_throughput.py --preset deepseek-v3 --tokens 4096 --doc-tokens 128 --packed 16 \
  --loss-share 0.44 --in-vocab 0.25 --warmup 12 --steps 96 --out "$OUT/dsv3.json" > "$OUT/dsv3.log" 2>&1
echo "dsv3 rc $? in $(($(date +%s) - t1)) s"; tail -4 "$OUT/dsv3.log" | cut -c1-400
left=$((560 - ($(date +%s) - t0)))
[ $left -gt 60 ] && STEPS=64 BUDGET_S=$left bash bench/perf.sh "$OUT/perf" e8v,e8va > /dev/null 2>&1
tail -30 "$OUT/perf/summary.md" 2>/dev/null
echo "all in $(($(date +%s) - t0)) s"
