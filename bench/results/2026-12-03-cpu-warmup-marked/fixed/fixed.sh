#!/usr/bin/env bash
# One fixed shape (no --packed): marked data dims (symbolic) against torch.compile's default
# (static, as the shape never changes). One warm inductor cache, 64 timed steps, alternating.
cd REPO
export TORCHINDUCTOR_CACHE_DIR=/tmp/warm/fixed/cache
i=0
for d in marked auto marked auto marked auto; do
  i=$((i+1))
  .venv/bin/python bench/train_throughput.py --preset tiny --device cpu --tokens 2048 --doc-tokens 256 \
      --warmup 3 --steps 64 --compile on --dynamic $d --out /tmp/warm/fixed/fixed-$i-$d.json > /tmp/warm/fixed/fixed-$i-$d.log 2>&1
  echo "$i $d rc $?" >> /tmp/warm/fixed/events.txt
done
