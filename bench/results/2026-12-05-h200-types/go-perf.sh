#!/usr/bin/env bash
# One device call: the training step of the draft-type seam ("new", this checkout) against the
# code before it ("old", `git archive c816da3 eaglet bench` unpacked in perfbase/), at perf.sh's
# e8 and ek shapes, each in the order old, new, new, old so that drift falls on both alike.
# The inductor cache is shared (a warm machine keeps it), so no run pays a cold compile alone.
#   OUT=... PARTS=e8 bash bench/results/2026-12-05-h200-types/go-perf.sh
#   OUT=... PARTS=ek WARM=1 bash bench/results/2026-12-05-h200-types/go-perf.sh   # a fresh machine: one
#        uncounted new run first fills the compile cache (a cold ek compile outlasts its limit)
set -u
OUT=${OUT:?}
export TORCHINDUCTOR_CACHE_DIR=/tmp/eaglet-inductor-cache
run() {  # run TREE NAME PART BUDGET
  local w=/tmp/perf-$2-$3
  rm -rf "$w"
  BUDGET_S=$4 PY=python3 bash "$1/bench/perf.sh" "$w" "$3" > "$OUT/$2-$3.log" 2>&1
  cp "$w/train.json" "$OUT/$3-$2-train.json" 2>/dev/null
  grep -h "tokens/s" "$w/perf.log" | tail -1
}
for part in ${PARTS//,/ }; do
  b=$([ $part = e8 ] && echo 100 || echo 135)
  [ "${WARM:-0}" = 1 ] && run . warm $part 220
  run perfbase old1 $part $b
  run . new1 $part $b
  run . new2 $part $b
  run perfbase old2 $part $b
done
echo ALLDONE
