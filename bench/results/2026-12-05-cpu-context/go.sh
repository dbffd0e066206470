#!/usr/bin/env bash
# tau by context length on a 2-core CPU: the demo-settings EAGLE-3 draft of 2026-12-05-cpu-types (its `base`:
# SmolLM2-135M-Instruct, 300 ShareGPT records cut to 256 tokens, a 1,024-token vocabulary, lr 3e-3, 3-step TTT),
# replayed greedy as a chain of 3 with 48 new tokens on the later turns of the records after the 300 trained on
# (heldout_turns: each conversation of two user turns or more asks its last one after the earlier turns) and, for
# comparison, on their opening turns (heldout); prompts up to 8,192 tokens (SmolLM2's context), 48 per set.
# The draft is not trained again: W is a fresh folder holding copies of cpu-types' W/base and W/runs/base-s0
# (ab.py skips a variant measured already in its W, so the new set needs a W of its own):
#   mkdir -p $W/runs && cp -a /tmp/cputypes/W/base $W/base && cp -a /tmp/cputypes/W/runs/base-s0 $W/runs/
#   (then point $W/runs/base-s0/{prepare,extract,vocab} at $W/base/...)
# No sampled replay (--replay-temperature): its side keeps every position's probabilities, too large at 2k tokens.
cd "$(dirname "$0")/../../.." || exit 1
W=${WORK:-/tmp/cpuctx/W}
.venv/bin/python bench/ab.py --work "$W" --target ~/.cache/eaglet/smollm2-135m-instruct \
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 300 --prompts 48 \
   --max-new-tokens 48 --k 3 --batch 8 --seeds 0 --sets heldout_turns heldout --max-prompt-tokens 8192 \
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline \
   --set extract.batch_tokens=4096 --set vocab.size=1024 --set train.epochs=4 --set train.max_tokens=1024 \
   --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08 \
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000 \
   --set extract.draft_types=[dflash] --set dflash.block_size=4 --set eval.chain_tokens=3 \
   --variant base
