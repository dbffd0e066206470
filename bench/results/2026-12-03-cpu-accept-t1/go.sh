#!/usr/bin/env bash
# The acceptance term at temperature 1, at the demo's settings (four epochs) on a 2-core CPU:
# log_accept (the default, weight 1) against tv, log_accept at weight 2, and no term.
cd "$(dirname "$0")/../../.." || exit 1
.venv/bin/python bench/ab.py --work /tmp/acab/W --target ~/.cache/eaglet/smollm2-135m-instruct \
    --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 150 --prompts 48 \
    --max-new-tokens 48 --k 3 --batch 16 --seeds 0 1 --replay-temperature 1 \
    --variant base --variant tv:train.accept_loss=tv --variant la2:train.accept_weight=2 \
    --variant none:train.accept_loss=none \
    --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline \
    --set extract.batch_tokens=4096 --set vocab.size=4096 --set train.epochs=4 --set train.max_tokens=1024 \
    --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08 \
    --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000
