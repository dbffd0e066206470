#!/usr/bin/env bash
# Builds, on this machine, vLLM 0.25.0 for the GPU image (Python 3.12, torch 2.11.0, transformers 5.17):
# the vllm wheel (--no-deps) and those of its requirements that the image lacks and that
# `from vllm import LLM` and an EAGLE-3 or DFlash LLM.generate on one GPU (FLASH_ATTN) import, as one
# tar cut into equal parts of at most 55 MB, so each rides one device call (64 MiB with the tree):
#   .whl-vllm/vllm/vllm-set.part-aa, -ab, ...   the tar of wheels/*.whl, in order
#   .whl-vllm/vllm/SHA256SUMS                    the parts' checksums (bench/device.sh's dev_vllm reads it)
#   .whl-vllm/vllm/WHEELS                        the wheels in the tar, with their sizes
# All of it is ignored by git. The tar is made byte for byte the same on every run (names sorted, times
# and owners fixed), so a rebuild leaves parts already carried valid. Idempotent; pip's cache makes a
# second run quick. The vllm wheel comes from PyPI, or from VLLM_WHEEL (a path) where that is set.
#
#   bash bench/vllm_payload.sh            # download and pack
#   bash bench/vllm_payload.sh WHEELDIR   # pack the wheels in WHEELDIR instead (the tests; VLLM_PART_BYTES
#                                         # sets the part limit there)
#
# Left out on purpose (vLLM lists them; nothing on the generate path imports them, or it guards the
# import): flashinfer-python/-cubin (the sampler's import of it is switched off by dev_vllm's
# VLLM_USE_FLASHINFER_SAMPLER=0), tilelang, nvidia-cutlass-dsl, quack-kernels, tokenspeed-mla,
# humming-kernels, nvidia-cudnn-frontend, fastsafetensors, nvtx (Blackwell, MoE, MLA and profiling
# kernels), torchcodec, PyNvVideoCodec, mistral_common (media and Mistral tokenizers), opentelemetry-*,
# mcp, anthropic, model-hosting-container-standards, prometheus-fastapi-instrumentator, watchfiles,
# python-json-logger (the API server), compressed-tensors (quantized checkpoints only), depyf (compile
# debug dumps), numba (the CPU n-gram proposer; the image's 0.68 is not vLLM's 0.65), lm-format-enforcer,
# outlines_core, diskcache (structured-output backends and their cache, loaded for such requests only),
# lark, jsonschema (vLLM imports neither), blake3 (the multimodal hasher), setproctitle (its import is
# guarded), ijson (the Mistral tool parser), jiter (openai's streaming helpers).
# xgrammar and llguidance stay: vLLM's structured-output module names their classes in dataclass fields,
# which Python evaluates when `vllm.v1.request` is imported.
set -euo pipefail
FROM=${1:+$(realpath "$1")}
cd "$(dirname "$0")/.."
OUTDIR=.whl-vllm/vllm
PART_LIMIT=${VLLM_PART_BYTES:-55000000}
VLLM_PIN=vllm==0.25.0
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  fastapi==0.136.3 starlette==1.10.0 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5
  sniffio==1.3.1 openai-harmony==0.0.8 llguidance==1.7.6 xgrammar==0.2.3 apache-tvm-ffi==0.1.9
  pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0 cachetools==8.0.2 pybase64==1.5.1
  partial-json-parser==0.2.1.1.post7)
# The image runs glibc 2.39: llguidance's wheel is manylinux_2_31.
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_31 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
PIP=(env PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/pip download -q --no-deps --only-binary=:all:
  --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/wheels"
if [ -n "$FROM" ]; then
  cp "$FROM"/*.whl "$STAGE/wheels/"
else
  if [ -n "${VLLM_WHEEL:-}" ]; then
    cp "$VLLM_WHEEL" "$STAGE/wheels/"
  else
    "${PIP[@]}" -d "$STAGE/wheels" "$VLLM_PIN"
  fi
  "${PIP[@]}" -d "$STAGE/wheels" "${WHEELS[@]}"
  if [ "$(ls "$STAGE"/wheels/*.whl | wc -l)" -ne $((${#WHEELS[@]} + 1)) ]; then
    echo "vllm_payload: expected $((${#WHEELS[@]} + 1)) wheels, got $(ls "$STAGE"/wheels | wc -l)" >&2
    exit 1
  fi
fi
count=$(ls "$STAGE"/wheels/*.whl | wc -l)

tar -C "$STAGE" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$STAGE/vllm-set.tar" wheels
size=$(stat -c %s "$STAGE/vllm-set.tar")
parts=$(( (size + PART_LIMIT - 1) / PART_LIMIT ))
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR"
(cd "$STAGE/wheels" && stat -c '%s %n' *.whl) > "$OUTDIR/WHEELS"
split -n "$parts" -a 2 "$STAGE/vllm-set.tar" "$OUTDIR/vllm-set.part-"
(cd "$OUTDIR" && sha256sum vllm-set.part-* > SHA256SUMS)
echo "$count wheels, $size bytes, $parts parts in $OUTDIR:"
(cd "$OUTDIR" && stat -c '  %n %s' vllm-set.part-*)
