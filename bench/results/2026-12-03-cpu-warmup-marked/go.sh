#!/usr/bin/env bash
# CPU warm-up: each run with an empty inductor cache, one after another.
cd REPO
i=0
for d in marked auto on marked auto on; do
  i=$((i+1))
  export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/warm/cache.XXXX)
  .venv/bin/python bench/train_throughput.py --preset tiny --device cpu --tokens 2048 --doc-tokens 256 --packed 8 \
      --warmup 4 --steps 24 --compile on --dynamic $d --out /tmp/warm/train-$i-$d.json > /tmp/warm/train-$i-$d.log 2>&1
  echo "$i $d rc $?" >> /tmp/warm/events.txt
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
done
