# Functions for a device call's script (source it): the A/B target and data, the wheels, a driver
# started in the background that outlives the call, and what comes back under $OUT.
#
#   source bench/device.sh
#   dev_data                  # ShareGPT 7k -> $DEV/D/sg7k.json, MT-bench -> $DEV/cache (EAGLET_CACHE)
#   dev_stash gguf.part-aa    # a carried part of the target's GGUF kept for a later call
#   dev_target                # the parts joined, checked and converted: $DEV/G/smollm2; wheels in $DEV/site
#   dev_vllm_part vllm-set.part-aa  # a carried part of vLLM's wheel set kept in $DEV/V for a later call
#   dev_vllm                  # all six parts there: checked, joined, vLLM installed into $DEV/site
#   dev_start DRIVER.sh       # run DRIVER.sh (setsid, logs in $DEV/L) and return at once
#   dev_wait 450; dev_collect # until $DEV/L/ALLDONE or 450 s; results, train logs and logs to $OUT
#
# A call carries at most 64 MiB, the tree included, so the 98 MB GGUF travels in two parts over two
# calls (.whl-vllm/smol/gguf.part-aa, -ab, SHA256SUMS), and the wheels may go ahead of the start
# (`dev_wheels .whl/*.whl`); the machine keeps /tmp between calls made within 30 s of each other.
# bench/device_payload.sh builds what the calls carry. A driver writes its ab.py work folder to $DEV/W.
# vLLM 0.25.0 and the wheels it needs beyond the image (bench/vllm_payload.sh) travel as one tar in six
# parts of about 52 MB, one a call (.whl-vllm/vllm/vllm-set.part-aa ... -af, with SHA256SUMS in any call);
# dev_vllm also sets VLLM_USE_FLASHINFER_SAMPLER=0, as FlashInfer is not carried.

DEV=${DEV:-/tmp}
SMOL=.whl-vllm/smol
VSET=.whl-vllm/vllm
export PYTHONPATH=$DEV/site:$DEV/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export EAGLET_CACHE=$DEV/cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

dev_data() {
  mkdir -p "$DEV/D" "$DEV/cache"
  (cd .whl-vllm/ab && sha256sum -c --quiet SHA256SUMS) || return 3
  xz -dc .whl-vllm/ab/sharegpt7k.json.xz > "$DEV/D/sg7k.json" && cp .whl-vllm/ab/mt_bench_question.jsonl "$DEV/cache/"
}

dev_stash() {
  mkdir -p "$DEV/P"
  if [ -e "$SMOL/$1" ]; then mv "$SMOL/$1" "$DEV/P/"; fi
}

dev_wheels() {  # dev_wheels WHEEL...: those present installed into $DEV/site (an earlier call may have carried some)
  local w=() f
  for f in "$@"; do [ -e "$f" ] && w+=("$f"); done
  [ ${#w[@]} -eq 0 ] && return 0
  pip install --no-index --no-deps --target "$DEV/site" --upgrade -q "${w[@]}" 2>&1 | grep -v "as the 'root' user" || true
}

dev_vllm_part() {  # dev_vllm_part NAME: a part carried in this call moved to $DEV/V (with SHA256SUMS, if carried)
  mkdir -p "$DEV/V"
  if [ -e "$VSET/SHA256SUMS" ]; then cp "$VSET/SHA256SUMS" "$DEV/V/"; fi
  if [ -e "$VSET/$1" ]; then mv "$VSET/$1" "$DEV/V/"; fi
}

dev_vllm() {  # every part in $DEV/V (or carried now): checked, joined, untarred, installed into $DEV/site once
  local part missing=() sums bad
  mkdir -p "$DEV/V"
  if [ -e "$VSET/SHA256SUMS" ]; then cp "$VSET/SHA256SUMS" "$DEV/V/"; fi
  [ -e "$DEV/V/SHA256SUMS" ] || { echo "dev_vllm: no SHA256SUMS: carry $VSET/SHA256SUMS"; return 3; }
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
  sums=$(sha256sum < "$DEV/V/SHA256SUMS" | cut -c1-64)
  [ "$(cat "$DEV/V/installed" 2>/dev/null)" = "$sums" ] && return 0
  for part in $(awk '{print $2}' "$DEV/V/SHA256SUMS"); do
    dev_vllm_part "$part"
    [ -e "$DEV/V/$part" ] || missing+=("$part")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "dev_vllm: missing ${missing[*]}: carry $VSET/${missing[0]} and call dev_vllm_part ${missing[0]}"
    return 3
  fi
  bad=$(cd "$DEV/V" && sha256sum -c SHA256SUMS 2>/dev/null | grep -v ': OK$' | cut -d: -f1 | tr '\n' ' ')
  [ -z "$bad" ] || { echo "dev_vllm: ${bad}differs from SHA256SUMS: carry it again with dev_vllm_part"; return 3; }
  rm -rf "$DEV/V/wheels"
  (cd "$DEV/V" && cat $(awk '{print $2}' SHA256SUMS) | tar -x) || { echo "dev_vllm: the joined parts are not a tar"; return 4; }
  dev_wheels "$DEV"/V/wheels/*.whl
  python3 -c "from vllm import LLM, SamplingParams" || { echo "dev_vllm: vLLM installed in $DEV/site does not import"; return 5; }
  echo "$sums" > "$DEV/V/installed"
}

dev_target() {
  dev_stash gguf.part-aa; dev_stash gguf.part-ab
  cp "$SMOL/SHA256SUMS" "$DEV/P/" && (cd "$DEV/P" && sha256sum -c --quiet SHA256SUMS) || return 3
  dev_wheels "$SMOL"/gguf-*.whl .whl/*.whl
  rm -rf "$DEV/src" && mkdir -p "$DEV/src" "$DEV/L" "$DEV/G" && cp -r eaglet bench "$DEV/src/"
  python3 -c "import speculators.models.eagle3, speculators.losses" || return 6
  [ -d "$DEV/G/smollm2" ] && return 0
  cat "$DEV/P/gguf.part-aa" "$DEV/P/gguf.part-ab" > "$DEV/G/SmolLM2-135M-Instruct.Q4_1.gguf"
  python3 -c "
from pathlib import Path
from eaglet.demo import gguf_to_folder
gguf_to_folder(Path('$DEV/G/SmolLM2-135M-Instruct.Q4_1.gguf'), Path('$DEV/G/smollm2'))" > "$DEV/L/convert.log" 2>&1 || return 4
}

dev_start() {
  mkdir -p "$DEV/L"
  echo "$(date +%s) start" >> "$DEV/L/events.txt"
  (cd "$DEV/src" && setsid nohup bash "$1" > "$DEV/L/driver.log" 2>&1 < /dev/null &)
}

dev_job() {  # dev_job NAME CMD...: run CMD, its output in $DEV/L/NAME.log, its exit status in events.txt
  local name=$1 rc; shift
  "$@" > "$DEV/L/$name.log" 2>&1; rc=$?
  echo "$(date +%s) $name rc $rc" >> "$DEV/L/events.txt"
  return $rc
}

dev_wait() {
  local t=0
  while [ $t -lt "$1" ] && [ ! -e "$DEV/L/ALLDONE" ]; do sleep 5; t=$((t + 5)); done
}

dev_collect() {
  mkdir -p "$OUT"
  (cd "$DEV/W" 2>/dev/null && tar czf "$OUT/res.tgz" results decode ab.md ab.json 2>/dev/null)
  (cd "$DEV/W/runs" 2>/dev/null && tar czf "$OUT/trainlogs.tgz" */train/log.jsonl */train/manifest.json \
    */train/speculators/train_log.jsonl 2>/dev/null)
  (cd "$DEV" && tar czf "$OUT/logs.tgz" L 2>/dev/null)
  cat "$DEV/L/events.txt" 2>/dev/null
  for f in "$DEV"/L/*.log; do echo "== $f"; tail -2 "$f" | cut -c1-300; done
  cat "$DEV/W/ab.md" 2>/dev/null
}

# The A/B's training and tree replays, for a driver that sets AB=(python3 bench/ab.py --work $DEV/W ...):
#   dev_ab_train NAME SEED VARIANT  one draft trained and measured, on an empty inductor cache of its own
#   dev_ab_tree D                   draft D (seed 0) replayed as the EAGLE-2 tree, greedy and at temperature 1
dev_ab_train() {
  local n=$1 s=$2; shift 2
  TORCHINDUCTOR_CACHE_DIR=$DEV/ind-$n-s$s dev_job t-$n-s$s "${AB[@]}" --seeds "$s" --variant "$@"
}

dev_ab_tree() {
  TORCHINDUCTOR_CACHE_DIR=$DEV/ind-tree dev_job tree-$1 "${AB[@]}" --seeds 0 --variant "$1" --only "$1" \
    --decode tree-replay:0 tree-replay:1 --decode-prompts "${TREE_PROMPTS:-256}" --decode-new-tokens "${TREE_NEW_TOKENS:-128}"
}
