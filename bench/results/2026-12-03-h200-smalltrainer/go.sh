#!/usr/bin/env bash
# eaglet train at SmolLM2-135M-Instruct's width on a random target (bench/small_trainer.py), one H200, one inductor
# cache: online states 250 steps (empty cache), then a 40-step host profile; then the offline store the same way.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCHINDUCTOR_CACHE_DIR=/tmp/ind TOKENIZERS_PARALLELISM=false
nvidia-smi -L
for m in online offline; do t0=$(date +%s); lim=$([ $m = online ] && echo 150 || echo 100)
  timeout $lim python3 bench/small_trainer.py --out /tmp/st --mode $m --steps 250 --host-profile 40 > "$OUT/$m.log" 2>&1
  echo "$m rc $? in $(($(date +%s) - t0)) s"; cp /tmp/st/small-$m.json "$OUT/" 2>/dev/null
  grep "^\[small\]" "$OUT/$m.log"; done
