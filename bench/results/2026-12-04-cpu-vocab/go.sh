#!/usr/bin/env bash
# The draft vocabulary's size at the demo's scale on a 2-core CPU: 1,024 (v1k), 2,048 (v2k) and 8,192 (v8k) beside the
# 4,096 of base (bench/results/2026-12-03-cpu-ttt: the same work folder and settings; its drafts are measured
# already and not trained again), two seeds each, the same steps, replayed as chains of 7 and as the tree
# (10/6/60), greedy and at temperature 1, on the same 48 prompts. Each variant builds its own vocabulary
# (bench/ab.py: a variant setting vocab.* runs the vocab stage in its own folder).
cd "$(dirname "$0")/../../.." || exit 1
A=(.venv/bin/python bench/ab.py --work /tmp/tttab/W --target ~/.cache/eaglet/smollm2-135m-instruct
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 150 --prompts 48
   --max-new-tokens 48 --k 7 --batch 16 --seeds 0 1 --replay-temperature 1
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline
   --set extract.batch_tokens=4096 --set vocab.size=4096 --set train.epochs=4 --set train.max_tokens=1024
   --set train.ttt_steps=7 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000)
V=(--variant base --variant v1k:vocab.size=1024 --variant v2k:vocab.size=2048 --variant v8k:vocab.size=8192)
"${A[@]}" "${V[@]}"
"${A[@]}" "${V[@]}" --only v1k v2k v8k --decode tree-replay:0 tree-replay:1 --decode-prompts 48 --decode-new-tokens 48
