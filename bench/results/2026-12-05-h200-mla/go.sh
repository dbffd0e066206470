#!/usr/bin/env bash
# EAGLE-3's dense and MLA draft layers (train.draft_attention) side by side on one H200
# (docs/kimi-k25.md "Dense or MLA draft layer"). Parts, named in PARTS (default: a b c):
#   a  bench/train_throughput.py at Kimi-K2.5's draft dims (--preset kimi-k2, 4096 tokens), dense then
#      MLA in the same call: training tokens/s and peak memory. Needs nothing beyond the image
#      (A_ARGS: more of its flags, after these, e.g. "--preset tiny --device cpu --tokens 256" on a CPU).
#   b  the random DeepSeek-V3-architecture checkpoint of bench/fullwidth.py (full width, LAYERS layers,
#      EXPERTS experts; its vocabulary the tokenizer's, so that its greedy outputs are text), its own
#      greedy replies as data (`eaglet regenerate`), a dense and an MLA draft trained on them (STEPS_B
#      steps, states online), each evaluated in process and in vLLM (eval.vllm on: vLLM's mean
#      acceptance length must be within eval.vllm_tolerance, 5%, of eaglet's tau), then vLLM's KV cache
#      a token for the target alone and with each draft (kv_probe.py: the cache spec of every layer).
#      B_DIMS=SMOKE B_DEVICE=cpu CHATS=24 B_SETS="--set ..." run its steps at bench/fullwidth.py's CPU dims.
#   c  SmolLM2-135M-Instruct and the demo's ShareGPT file (bench/engine_eval.sh, STEPS_C steps): a dense
#      and an MLA draft, tau in process, then in vLLM (whether vLLM serves an MLA draft beside a
#      non-MLA target is itself a result: its log says).
# b and c need vLLM installed (bench/device.sh dev_vllm, after carrying bench/vllm_payload.sh's parts);
# c also the converted SmolLM2 and the data (dev_target, dev_data). Each result is copied into RES
# (default $OUT, else $DEV/R) as soon as it exists, at most 8 files in all: a-{dense,mla}.json,
# b-kv.json, b-{dense,mla}.tgz, c-{dense,mla}.tgz, and logs.tgz at the end. Logs: $DEV/L (dev_job).
#   OUT=$OUT PARTS=a bash bench/results/2026-12-05-h200-mla/go.sh                # in the foreground, one call
#   source bench/device.sh && export PARTS=b && dev_start bench/results/2026-12-05-h200-mla/go.sh  # background
set -u
source bench/device.sh
HERE=bench/results/2026-12-05-h200-mla
RES=${RES:-${OUT:-$DEV/R}}
mkdir -p "$RES" "$DEV/L"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$DEV/inductor}
DRAFTS=${DRAFTS:-dense mla}

part_a() {  # the training step at Kimi-K2.5's draft dims, dense then MLA
  local att
  for att in $DRAFTS; do
    dev_job "a-$att" python3 bench/train_throughput.py --preset kimi-k2 --tokens 4096 --draft-attention "$att" \
      --warmup "${WARMUP_A:-3}" --steps "${STEPS_A:-10}" ${A_ARGS:-} --out "$RES/a-$att.json"
    tail -1 "$DEV/L/a-$att.log"
  done
}

part_b() {  # a random DeepSeek-V3-architecture target: its own greedy replies, two drafts, eval, KV cache
  local W=$DEV/B att X=(${B_SETS:-})
  local T=$W/target
  mkdir -p "$W"
  [ -f "$W/config.yaml" ] || echo "{}" > "$W/config.yaml"  # every setting is given below
  if [ ! -f "$T/config.json" ]; then
    dev_job b-target python3 - "$T" "${LAYERS:-4}" "${EXPERTS:-64}" "$W/chats.jsonl" "${CHATS:-800}" \
      "${B_DIMS:-FULL}" "${B_DEVICE:-cuda}" <<'EOF' || return 1
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import fullwidth
from eaglet.testing import tiny
out, layers, experts, chats, n, dims, device = sys.argv[1:]
out, chats = Path(out), Path(chats)
vocab = len(tiny.build_tokenizer("chatml", vocab_size=2048, seed=0))  # the tokenizer build_target saves beside it
fullwidth.build_target(out, int(layers), int(experts), {**getattr(fullwidth, dims), "vocab_size": vocab}, device)
config = json.loads((out / "config.json").read_text())
config["topk_method"] = "noaux_tc"  # vLLM 0.25 loads e_score_correction_bias only then (bench/stream_vllm.py)
(out / "config.json").write_text(json.dumps(config, indent=2))
tiny.write_jsonl(chats, tiny.make_conversations(int(n), seed=1, max_turns=2))
print(f"target {out}: vocabulary {vocab}, {layers} layers, {experts} experts")
EOF
  fi
  local G=(--set "target.path=$T" --set target.dtype=bfloat16 --set prepare.max_length=1024
           --set "extract.layers=[$(seq -s, 1 $((${LAYERS:-4} - 1)))]")  # as bench/fullwidth.py captures them
  if [ ! -f "$W/regen.jsonl.manifest.json" ]; then
    dev_job b-regenerate python3 -m eaglet.cli regenerate "$W/config.yaml" "${G[@]}" \
      --set "prepare.data=[$W/chats.jsonl]" --set "regenerate.out=$W/regen.jsonl" \
      --set regenerate.max_new_tokens=128 --set regenerate.temperature=0.0 "${X[@]}" || return 1
  fi
  python3 "$HERE/kv_probe.py" --target "$T" --name target --out "$RES/b-kv.json" > "$DEV/L/b-kv-target.log" 2>&1
  for att in $DRAFTS; do
    local R=("${G[@]}" --set "run.dir=$W/run-$att" --set "prepare.data=[$W/regen.jsonl]" --set extract.mode=online
             --set vocab.size=512 --set train.max_tokens=4096 --set train.ttt_steps=7 --set train.lr=0.0003
             --set train.warmup_steps=30 --set "train.max_steps=${STEPS_B:-200}" --set train.epochs=1000
             --set train.log_every=25 --set train.eval_every=0 --set "train.ckpt_every=${STEPS_B:-200}"
             --set train.keep_last=1 --set train.tensorboard=false --set "train.draft_attention=$att"
             --set export.speculative_tokens=3 --set eval.chain_tokens=3 --set eval.max_new_tokens=64
             --set eval.num_prompts=16 --set eval.vllm=on --set "eval.vllm_batch_sizes=[1,8]"
             --set "eval.vllm_engine_args={gpu_memory_utilization: 0.45}")
    dev_job "b-$att-train" python3 -m eaglet.cli run "$W/config.yaml" "${R[@]}" "${X[@]}" --until export
    rm -rf "$W/run-$att/train/checkpoints"  # ~10 GiB each: the disk holds the target, the finals and the exports
    dev_job "b-$att-eval" python3 -m eaglet.cli eval "$W/config.yaml" "${R[@]}" "${X[@]}"
    python3 "$HERE/kv_probe.py" --target "$T" --draft "$W/run-$att/export/vllm" --name "$att" \
      --out "$RES/b-kv.json" > "$DEV/L/b-kv-$att.log" 2>&1
    (cd "$W/run-$att" && tar czf "$RES/b-$att.tgz" eval/*.json export/vllm/config.json train/log.jsonl \
      train/manifest.json 2>/dev/null)
  done
}

part_c() {  # SmolLM2-135M-Instruct: a dense and an MLA draft, tau in process, then in vLLM
  local att W E=${EVAL_SETS:-}
  local A=("$DEV/G/smollm2" "$DEV/D/sg7k.json" "${STEPS_C:-1200}")  # every phase the same steps: the same train
  for att in $DRAFTS; do
    W=$DEV/C/$att
    export TYPE_SETS="--set train.draft_attention=$att"
    dev_job "c-$att-train" bash bench/engine_eval.sh train "$W" "${A[@]}"
    EVAL_SETS="$E --set eval.vllm=off" dev_job "c-$att-inprocess" bash bench/engine_eval.sh heldout "$W" "${A[@]}"
    cp "$W/run/eval/eval.json" "$W/run/eval-inprocess.json" 2>/dev/null
    EVAL_SETS="$E" dev_job "c-$att-vllm" bash bench/engine_eval.sh heldout "$W" "${A[@]}"
    grep -h "GPU KV cache size\|Available KV cache memory\|backend" "$W/logs/heldout.log" > "$W/logs/kv.txt" 2>/dev/null
    (cd "$W" && tar czf "$RES/c-$att.tgz" run/eval-inprocess.json run/eval/*.json run/export/vllm/config.json \
      run/train/log.jsonl logs/kv.txt 2>/dev/null)
  done
}

for part in ${PARTS:-a b c}; do
  echo "$(date +%s) part $part" >> "$DEV/L/events.txt"
  "part_$part"
done
(cd "$DEV" && tar czf "$RES/logs.tgz" L 2>/dev/null)
touch "$DEV/L/ALLDONE"
