#!/usr/bin/env bash
# The draft vocabulary's size with the demo's own settings on a 2-core CPU (eaglet/demo.py CPU_SETTINGS: 150
# records cut to 256 tokens, offline store, four epochs of 28 steps, a 3-step TTT, lr 3e-3, log_accept, no
# out-of-vocabulary mask): the demo's 4,096 (base) against 1,024 (v1k) and 2,048 (v2k), two seeds each, replayed
# as chains of 3 (the demo's eval) greedy and at temperature 1 on 48 unseen prompts of 48 new tokens, then as
# the tree (10/6/60) on 45 new tokens (the chain's continuations hold 48 + 3: a depth-6 tree needs 6 beyond).
cd "$(dirname "$0")/../../.." || exit 1
A=(.venv/bin/python bench/ab.py --work /tmp/demovocab/W --target ~/.cache/eaglet/smollm2-135m-instruct
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 150 --prompts 48
   --max-new-tokens 48 --k 3 --batch 16 --seeds 0 1 --replay-temperature 1
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline
   --set extract.batch_tokens=4096 --set vocab.size=4096 --set train.epochs=4 --set train.max_tokens=1024
   --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000)
V=(--variant base --variant v1k:vocab.size=1024 --variant v2k:vocab.size=2048)
"${A[@]}" "${V[@]}"
"${A[@]}" "${V[@]}" --decode tree-replay:0 tree-replay:1 --decode-prompts 48 --decode-new-tokens 45
