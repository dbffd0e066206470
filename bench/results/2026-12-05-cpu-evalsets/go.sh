#!/usr/bin/env bash
# The demo-settings EAGLE-3 draft of 2026-12-05-cpu-types (its `base`: SmolLM2-135M-Instruct, 300 ShareGPT
# records cut to 256 tokens, a 1,024-token vocabulary, a 3-step TTT, log_accept, lr 3e-3, trained once on a
# 2-core CPU) replayed on the named eval sets as chains of 3, greedy and at temperature 1, on the first 48
# prompts of each set, 48 new tokens: held-out ShareGPT turns, GSM8K, MATH-500, HumanEval and MT-bench
# (their first turns). The draft is not trained again: bench/ab.py adds the sets its result lacks. The same
# arguments as 2026-12-05-cpu-types/go.sh, so the held-out target sides of that run are reused.
# Run as `OMP_NUM_THREADS=1 bash go.sh`: the 2 cores were shared with two other runs, and with torch's 2 threads
# each the first call's sampled GSM8K side took 728 s against 48 s greedy (ab-1.log; stopped there, its
# two GSM8K sides kept); the second call, one thread, made the rest (ab-2.log). tau does not depend on time.
cd "$(dirname "$0")/../../.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's eaglet, whichever .venv
W=${WORK:-/tmp/cputypes/W}
A=(.venv/bin/python bench/ab.py --work $W --target ~/.cache/eaglet/smollm2-135m-instruct
   --data ~/.cache/eaglet/ShareGPT_V3_unfiltered_cleaned_split.json --records 300 --prompts 48
   --max-new-tokens 48 --k 3 --batch 16 --seeds 0 --replay-temperature 1
   --set prepare.max_length=256 --set target.dtype=float32 --set extract.mode=offline
   --set extract.batch_tokens=4096 --set vocab.size=1024 --set train.epochs=4 --set train.max_tokens=1024
   --set train.ttt_steps=3 --set train.lr=0.003 --set train.warmup_steps=10 --set train.eval_fraction=0.08
   --set train.accept_loss=log_accept --set train.mask_out_of_vocab=false --set train.max_steps=100000
   --set extract.draft_types=[dflash] --set dflash.block_size=4 --set eval.chain_tokens=3)
"${A[@]}" --variant base --sets heldout gsm8k math500 humaneval mt_bench
# ab.md and ab.json of this draft alone (W holds the other types' results too): its result summarised apart
R=${REPORT:-/tmp/evalsets/report}
mkdir -p "$R/results" && cp "$W/results/base-s0.json" "$R/results/"
"${A[@]}" --report --work "$R"  # the last --work counts
cp "$R/ab.md" "$R/ab.json" "$(dirname "$0")/"
