#!/usr/bin/env bash
# EAGLE-3's dense layer against its MLA layer (train.draft_attention: mla) on a 2-core CPU with the demo's
# settings (SmolLM2-135M-Instruct, 300 ShareGPT records cut to 256 tokens, offline store, a 1,024-token
# vocabulary, lr 3e-3, a 3-step TTT): the MLA sizes are the rule's for a dense target (9 heads, q_lora 768,
# kv_lora 256, nope 64, rope 32, v 64). mlacal calibrates the MLA draft's seconds a step; mla trains it for
# the dense base's time, mla-steps for the base's steps; all replayed as chains of 3, greedy and at
# temperature 1, on 48 unseen prompts of 48 new tokens. The same work folder as ../2026-12-05-cpu-types (its
# prepared data, store and base run are reused).
cd "$(dirname "$0")/../../.." || exit 1
A=(.venv/bin/python bench/ab.py --work ${WORK:-/tmp/cputypes/W} --target ~/.cache/eaglet/smollm2-135m-instruct
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 300 --prompts 48
   --max-new-tokens 48 --k 3 --batch 16 --seeds 0 --replay-temperature 1
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline
   --set extract.batch_tokens=4096 --set vocab.size=1024 --set train.epochs=4 --set train.max_tokens=1024
   --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000
   --set extract.draft_types=[dflash] --set dflash.block_size=4 --set eval.chain_tokens=3)
V=(--variant base --variant mlacal:train.draft_attention=mla,train.max_steps=60
   --variant mla:train.draft_attention=mla,time_of=base,rate_of=mlacal
   --variant mla-steps:train.draft_attention=mla,train.max_steps=216)
"${A[@]}" "${V[@]}"
