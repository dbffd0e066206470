#!/usr/bin/env bash
# fc_norm / norm_output (EAGLE-3.1) against the demo's settings on a 2-core CPU.
cd REPO
.venv/bin/python bench/ab.py --work /tmp/fcab/W --target ~/.cache/eaglet/smollm2-135m-instruct \
    --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 150 --prompts 48 \
    --max-new-tokens 48 --k 3 --batch 16 --seeds 0 1 --replay-temperature 1 \
    --variant base --variant ep4:train.epochs=4 --variant ep5:train.epochs=5 \
    --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline \
    --set extract.batch_tokens=4096 --set vocab.size=4096 --set train.epochs=3 --set train.max_tokens=1024 \
    --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08 \
    --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000
