#!/usr/bin/env bash
# The training step of the draft-type seam ("new", this checkout) against the code before it ("old",
# `git archive c816da3 eaglet bench` in perfbase/), on this CPU: bench/train_throughput.py at
# SmolLM2-135M's draft dims, 1 x 512 tokens, 3 TTT steps, eager; old, new, new, old, old, new.
cd "$(dirname "$0")/../../.." || exit 1
[ -d perfbase ] || { mkdir perfbase && git archive c816da3 eaglet bench | tar -x -C perfbase; }
for who in old new new old old new; do
  if [ $who = old ]; then P=$PWD/perfbase; S=perfbase/bench/train_throughput.py; else P=$PWD; S=bench/train_throughput.py; fi
  PYTHONPATH=$P .venv/bin/python $S --device cpu --preset smollm2-135m --tokens 512 --ttt-steps 3 --compile off \
    --steps 6 --warmup 2 --out /tmp/step-$who-$RANDOM.json 2>&1 | grep "tokens/s" | sed "s/^/$who /"
done
