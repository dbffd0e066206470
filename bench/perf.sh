#!/usr/bin/env bash
# Issue 7's benchmarks in one call, on one GPU: eaglet's training step beside speculators'
# at the same shapes, and extraction against a plain forward. Writes into OUTDIR:
#   train.json    every training run (bench/train_throughput.py's JSON, one list)
#   extract.json  bench/extract_throughput.py's JSON
#   profile.txt   the top kernels of eaglet's packed 8B step (torch.profiler)
#   summary.md    the tables (bench/perf_summary.py), rewritten after every part
#   perf.log      everything printed
#
#   bash bench/perf.sh OUTDIR [PARTS]
#
# PARTS (comma-separated, default all, run in this order of priority):
#   e8p  eaglet, Llama-3.1-8B draft dims, 8192 tokens = 4 x 2048 documents (breakdown, profile, check)
#   s8p  speculators, the same shape
#   ext  extraction: 8B-shaped Llama (EXTRACT_LAYERS layers, default 32), 8 batches of 8 x 2048
#   ek   eaglet, Kimi-K2.5 draft dims (hidden 7168, vocab 163840), one 4096 sequence
#   sk   speculators, the same shape
#   e8   eaglet, 8B dims, one 2048 sequence (breakdown)
#   s8   speculators, the same shape
#   e8p0 eaglet, 8B packed, train.compile off (what compiling the step pieces buys)
#   e8pm, em8, ekm  eaglet at e8p's, e8's and ek's shapes with train.mask_out_of_vocab false: the
#        teacher over the draft columns only, the work speculators' step does (not in the default list)
#   e8pc eaglet at e8p's shape with each product casting its own weight, as before the TTT unroll
#        cast each weight once (what that buys; not in the default list)
#   e8c, ekc  eaglet at e8's and ek's shapes with the mask's verdicts known, as from a run's second
#        epoch on (train.VocabMaskCache): the teacher over the draft columns, the mask applied
#        (not in the default list)
#   e8s  eaglet at e8's shape with autograd summing the steps' weight gradients and a separate
#        clip pass, as before the GEMMs accumulated them and the fused AdamW clipped (what that
#        buys; not in the default list)
#   e8e, eke  eaglet at e8's and ek's shapes with each TTT step making layer 0's products of its
#        token embeddings, as before the unroll made them once (what that buys; not in the default list)
#   e8h, ekh  eaglet at e8's and ek's shapes with the LM head over every row of every step, as
#        before it ran over the rows each step's loss can count, and so (the active rows come from
#        those) steps 1.. over every row too (not in the default list)
#   e8r, ekr  eaglet at e8's and ek's shapes with TTT steps 1.. over every row, as before they ran
#        over the rows some later step counts (what that buys; not in the default list)
#   e8o, eko  eaglet at e8's and ek's shapes with torch's fused AdamW over fp32 gradients, as before
#        UnrollAdamW read the unroll's bf16 accumulators (what that buys; not in the default list)
#   e8v, e8va, e8vd  eaglet, 8B dims, 16 micro-batches of up to 8192 tokens in documents of
#        varying lengths around 1024 (--packed 16), 12 timed warm-up steps: the warm-up real data's
#        shapes cost; e8va with torch.compile's default (--dynamic auto: sizes symbolic once they
#        change), e8vd with every size symbolic from the first compile (--dynamic on); e8vf with the step-0
#        attention's flex_attention compiled by torch.compile's default (--flex-dynamic auto: again at the
#        second length); not in the default list
# Each part has its own time limit, and none starts past the overall BUDGET_S (default 570 s,
# under the 600 s a device command may run); a part cut short is marked in the summary.
#
# speculators 0.9.0 comes from wheels: bash ../shared/anchors/fetch_speculators_wheels.sh .whl
# here, then carry .whl; this script installs them into a temporary folder for its own runs.
# Without them the speculators parts are skipped. Env: PY (python3), BUDGET_S, EXTRACT_LAYERS,
# STEPS (timed steps, 8), WARMUP (3), WHL (.whl), SPEC_PY (a python that has speculators: used
# instead of the wheels); PERF_TINY=1 runs every part at tiny shapes
# on the CPU (a dry run of this script, in a minute or two).
set -u
out=${1:?usage: bench/perf.sh OUTDIR [PARTS]}
parts=${2:-e8p,s8p,ext,ek,sk,e8,s8,e8p0}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-570}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
WHL=${WHL:-.whl}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/eaglet-perf-XXXXXX)
log="$out/perf.log"
: >"$log"
start=$(date +%s)
# eaglet from this checkout where it is not installed (the GPU image): bench/ scripts import it
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/eaglet-inductor-cache}

say() { echo "$@" | tee -a "$log"; }

tiny_pre=() tiny_train=() tiny_ext=()
if [ "${PERF_TINY:-0}" = 1 ]; then  # compile's capture only (no C++ compilation), tiny shapes, CPU
  tiny_pre=(--compile on --compile-backend eager)
  tiny_train=(--preset tiny --device cpu --tokens 256 --doc-tokens 64 --profile-steps 1)
  tiny_ext=(--preset tiny --device cpu --batches 2 --layers 8)
fi

spec_path="" SPEC_PY=${SPEC_PY:-}
if [ -n "$SPEC_PY" ]; then
  spec_path=none  # an interpreter that has speculators already (e.g. .venv-speculators/bin/python)
elif ls "$WHL"/speculators-*.whl >/dev/null 2>&1; then
  site="$work/site"
  if $PY -m pip install -q --no-index --no-deps --target "$site" "$WHL"/*.whl >>"$log" 2>&1; then
    spec_path="$site"
  else
    say "perf: installing the speculators wheels from $WHL failed (see perf.log); speculators parts skipped"
  fi
else
  say "perf: no speculators wheels in $WHL (bash ../shared/anchors/fetch_speculators_wheels.sh $WHL); speculators parts skipped"
fi
$PY -c "import torch; print('perf: torch', torch.__version__, 'on', torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')" 2>&1 | tee -a "$log"

summary() { $PY "$here/perf_summary.py" "$out" "$work" >>"$log" 2>&1 || say "perf: summary failed"; }

# run NAME LIMIT_S CMD...: the command under `timeout`, within what is left of BUDGET_S
run() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET_S - ($(date +%s) - start)))
  if [ "$left" -lt 45 ]; then
    say "perf: $name skipped: ${left}s left of BUDGET_S=$BUDGET_S"
    echo "{\"part\": \"$name\", \"skipped\": \"time budget\"}" >"$work/$name.status.json"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  say "perf: === $name (limit ${limit}s, ${left}s left): $*"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local dt=$(($(date +%s) - t0))
  echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $dt, \"limit_s\": $limit}" >"$work/$name.status.json"
  say "perf: --- $name rc=$rc in ${dt}s"
  summary
}

train() {  # train NAME LIMIT SYSTEM ARGS...
  local name=$1 limit=$2 system=$3; shift 3
  if [ "$system" = speculators ]; then
    if [ -z "$spec_path" ]; then
      echo "{\"part\": \"$name\", \"skipped\": \"no speculators wheels\"}" >"$work/$name.status.json"
      return
    fi
    PYTHONPATH="$spec_path:$PYTHONPATH" run "$name" "$limit" ${SPEC_PY:-$PY} "$here/train_throughput.py" --system speculators \
      --loss-impl eager --warmup "$WARMUP" --steps "$STEPS" --out "$work/$name.json" "$@" ${tiny_train[@]+"${tiny_train[@]}"}
  else
    run "$name" "$limit" $PY "$here/train_throughput.py" --warmup "$WARMUP" --steps "$STEPS" \
      --out "$work/$name.json" ${tiny_pre[@]+"${tiny_pre[@]}"} "$@" ${tiny_train[@]+"${tiny_train[@]}"}
  fi
}

for p in ${parts//,/ }; do
  case $p in
    e8p) train e8p 200 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 2048 --breakdown --check --profile ;;
    s8p) train s8p 150 speculators --preset llama3-8b --tokens 8192 --doc-tokens 2048 ;;
    ext) run ext 150 $PY "$here/extract_throughput.py" --layers "${EXTRACT_LAYERS:-32}" --out "$work/ext.json" \
           ${tiny_ext[@]+"${tiny_ext[@]}"} ;;
    ek) train ek 150 eaglet --preset kimi-k2 --tokens 4096 --breakdown ;;
    sk) train sk 150 speculators --preset kimi-k2 --tokens 4096 ;;
    e8) train e8 120 eaglet --preset llama3-8b --tokens 2048 --breakdown ;;
    s8) train s8 120 speculators --preset llama3-8b --tokens 2048 ;;
    e8p0) train e8p0 90 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 2048 --compile off --breakdown ;;
    e8pm) train e8pm 120 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 2048 --no-vocab-mask --breakdown ;;
    em8) train em8 120 eaglet --preset llama3-8b --tokens 2048 --no-vocab-mask --breakdown ;;
    ekm) train ekm 150 eaglet --preset kimi-k2 --tokens 4096 --no-vocab-mask --breakdown ;;
    e8pc) train e8pc 120 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 2048 --per-product-casts --breakdown ;;
    e8c) train e8c 120 eaglet --preset llama3-8b --tokens 2048 --known-vocab-mask --breakdown ;;
    ekc) train ekc 150 eaglet --preset kimi-k2 --tokens 4096 --known-vocab-mask --breakdown ;;
    e8s) train e8s 120 eaglet --preset llama3-8b --tokens 2048 --summed-weight-grads --clip-pass --breakdown ;;
    e8e) train e8e 120 eaglet --preset llama3-8b --tokens 2048 --per-step-embeds --breakdown ;;
    eke) train eke 150 eaglet --preset kimi-k2 --tokens 4096 --per-step-embeds --breakdown ;;
    e8h) train e8h 120 eaglet --preset llama3-8b --tokens 2048 --all-head-rows --breakdown ;;
    ekh) train ekh 150 eaglet --preset kimi-k2 --tokens 4096 --all-head-rows --breakdown ;;
    e8r) train e8r 120 eaglet --preset llama3-8b --tokens 2048 --all-step-rows --breakdown ;;
    e8o) train e8o 120 eaglet --preset llama3-8b --tokens 2048 --plain-optimizer --breakdown ;;
    ekr) train ekr 150 eaglet --preset kimi-k2 --tokens 4096 --all-step-rows --breakdown ;;
    e8v) train e8v 300 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 1024 --packed 16 --warmup 12 ;;
    e8va) train e8va 300 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 1024 --packed 16 --warmup 12 \
            --dynamic auto ;;
    e8vd) train e8vd 300 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 1024 --packed 16 --warmup 12 \
            --dynamic on ;;
    e8vf) train e8vf 300 eaglet --preset llama3-8b --tokens 8192 --doc-tokens 1024 --packed 16 --warmup 12 \
            --flex-dynamic auto ;;
    eko) train eko 150 eaglet --preset kimi-k2 --tokens 4096 --plain-optimizer --breakdown ;;
    *) say "perf: unknown part $p" ;;
  esac
done
summary
cat "$out/summary.md" 2>/dev/null
say "perf: done in $(($(date +%s) - start))s; results in $out"
rm -rf "$work"
