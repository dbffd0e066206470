#!/usr/bin/env bash
# The training step at SmolLM2-135M-Instruct's draft shape (bench/ab.py's equal-time A/B), on one H200:
# where the equal-time run's steps go. bench/train_throughput.py, 8,192-token packed micro-batches of ~2,048-token
# documents (ShareGPT samples average ~1,600 at this template), one inductor cache for the eaglet runs (the first one cold):
#   e7   TTT 7 (the A/B's k), empty compile cache: its warm-up is the compile a cold run pays
#   e7w  the same again on the filled cache
#   e4, e5  TTT 4 and 5 (the same compiled pieces, called fewer times)
#   eoff TTT 7 eager (train.compile off)
#   s7   speculators 0.9.0's step at TTT 7, side by side
# Each prints and saves its figures (compile_times: torch.compile's seconds by phase).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
B=(python3 bench/train_throughput.py --preset smollm2-135m --tokens 8192 --doc-tokens 2048 --warmup 12)
run() { local n=$1 t0=$(date +%s); shift; timeout 150 "$@" --out "$OUT/$n.json" > "$OUT/$n.log" 2>&1; echo "$n rc $? in $(($(date +%s) - t0)) s"; tail -1 "$OUT/$n.log" | cut -c1-400; }
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-e
run e7 "${B[@]}" --packed 16 --ttt-steps 7 --steps 60
run e7w "${B[@]}" --packed 16 --ttt-steps 7 --steps 60
run e4 "${B[@]}" --packed 16 --ttt-steps 4 --steps 60
run e5 "${B[@]}" --packed 16 --ttt-steps 5 --steps 60
run eoff "${B[@]}" --packed 16 --ttt-steps 7 --steps 30 --compile off
TORCHINDUCTOR_CACHE_DIR=/tmp/ind-s run s7 "${B[@]}" --system speculators --ttt-steps 7 --steps 60
run e7h "${B[@]}" --packed 16 --ttt-steps 7 --steps 20 --host-profile 5 --breakdown
for n in e7 e7w e4 e5 eoff s7; do python3 -c "
import json; d=json.load(open('$OUT/$n.json'))
print('$n', round(d['tokens_per_s']), 'tok/s', round(d['step_ms'],1), 'ms/step; warmup', round(d['warmup_s'],1), 's', [round(x,1) for x in d['warmup_step_s'][:4]], 'graphs after', d.get('graphs_in_timed_steps'), 'host ms', round(sum(d['host_ms_each'])/len(d['host_ms_each']),1))
print(d.get('compile_times') or '')" 2>&1 | cut -c1-2000; done
