#!/usr/bin/env bash
# Where the demo's spare minutes go, on a 2-core CPU, with the demo's own settings (eaglet/demo.py CPU_SETTINGS:
# records cut to 256 tokens, offline store, a 3-step TTT, lr 3e-3, log_accept, a 1,024-token vocabulary):
# base = the demo (150 records, four epochs) against r300 (300 records, four epochs: twice the extraction and the
# steps) and e8 (150 records, eight epochs: twice the steps), two seeds each, replayed as chains of 3 (the demo's
# eval) greedy and at temperature 1 on 48 unseen prompts (records after the 300th) of 48 new tokens.
cd "$(dirname "$0")/../../.." || exit 1
A=(.venv/bin/python bench/ab.py --work /tmp/demobudget/W --target ~/.cache/eaglet/smollm2-135m-instruct
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 300 --prompts 48
   --max-new-tokens 48 --k 3 --batch 16 --seeds 0 1 --replay-temperature 1
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline
   --set extract.batch_tokens=4096 --set vocab.size=1024 --set train.epochs=4 --set train.max_tokens=1024
   --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000)
V=(--variant base:prepare.max_records=150 --variant r300 --variant e8:prepare.max_records=150,train.epochs=8)
"${A[@]}" "${V[@]}"
