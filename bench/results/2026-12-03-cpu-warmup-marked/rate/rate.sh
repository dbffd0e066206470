#!/usr/bin/env bash
# Steady rate: a warm inductor cache shared by the runs, 64 timed steps, alternating.
cd REPO
export TORCHINDUCTOR_CACHE_DIR=/tmp/warm/rate/cache
i=0
for d in marked auto marked auto marked auto; do
  i=$((i+1))
  .venv/bin/python bench/train_throughput.py --preset tiny --device cpu --tokens 2048 --doc-tokens 256 --packed 8 \
      --warmup 4 --steps 64 --compile on --dynamic $d --out /tmp/warm/rate/rate-$i-$d.json > /tmp/warm/rate/rate-$i-$d.log 2>&1
  echo "$i $d rc $?" >> /tmp/warm/rate/events.txt
done
