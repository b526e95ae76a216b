#!/usr/bin/env bash
# Create (or reuse) a virtual environment with ortcapture (editable, extras test, bench, webgpu; docs and serve-test
# in .venv), the pinned onnxruntime and WebGPU plugin EP, and set up software WebGPU on machines without a GPU.
# Idempotent.
#
# Usage: tools/bootstrap.sh [--ort VERSION] [--venv DIR] [--gpu-nocuda]
#   --ort   onnxruntime version to install (default: the newest supported, 1.32.0)
#   --venv  where to create the environment (default: .venv, or .venv-ort<VERSION> for other versions)
#   --gpu-nocuda  instead: a GPU user's venv on a machine without CUDA (default .venv-gpu-nocuda): onnxruntime-gpu
#           without its CUDA extras, the WebGPU plugin EP and ortcapture (editable, no extras), for
#           tests/test_gpu_nocuda.py (the CUDA EP is listed by ORT and does not load)
# stdout: two lines, the venv directory and the WebGPU env file to source (empty when WebGPU set-up failed).
set -euo pipefail
# pip's own output to stderr, without the "WARNING: Location 'file:///...' is ignored" lines a machine's pip
# configuration can print for every package (149 lines on a fresh user's run); pip's exit status is kept
quiet_pip() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2; }
NEWEST_ORT=1.32.0
WEBGPU_EP=0.4.0
NOCUDA_ORT_GPU=1.31.1  # the newest onnxruntime-gpu (CUDA 13); its wheel is ~244 MiB, kept in pip's cache
root=$(cd "$(dirname "$0")/.." && pwd)
ort_version=$NEWEST_ORT
venv=""
nocuda=0
while [ $# -gt 0 ]; do
  case "$1" in
    --ort) ort_version=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    --gpu-nocuda) nocuda=1; shift ;;
    *) echo "bootstrap: unknown argument $1" >&2; exit 2 ;;
  esac
done
log() { echo "bootstrap: $*" >&2; }
py=${PYTHON:-python3}
webgpu_env() {
  local env_file=""
  if env_file=$(bash "$root/tools/setup_webgpu.sh"); then :; else
    log "WebGPU software adapter set-up failed; WebGPU tests will fail"
    env_file=""
  fi
  echo "$env_file"
}
if [ $nocuda = 1 ]; then
  venv=${venv:-$root/.venv-gpu-nocuda}
  stamp="$venv/.ortcapture-stamp"
  want="nocuda ort-gpu=$NOCUDA_ORT_GPU webgpu=$WEBGPU_EP $(sha256sum "$root/pyproject.toml" | cut -c1-16)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "creating $venv (onnxruntime-gpu $NOCUDA_ORT_GPU without CUDA libraries)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check "onnxruntime-gpu==$NOCUDA_ORT_GPU" \
      "onnxruntime-ep-webgpu==$WEBGPU_EP; python_version >= '3.11'" -e "$root"
    echo "$want" > "$stamp"
  else
    log "reusing $venv (onnxruntime-gpu $NOCUDA_ORT_GPU without CUDA libraries)"
  fi
  echo "$venv"
  webgpu_env
  exit 0
fi
if [ -z "$venv" ]; then
  if [ "$ort_version" = "$NEWEST_ORT" ]; then venv="$root/.venv"; else venv="$root/.venv-ort$ort_version"; fi
fi
stamp="$venv/.ortcapture-stamp"
NUDENET=3.4.2  # the end-to-end library example (tests/test_library_example.py); --no-deps: it requires onnxruntime
want="ort=$ort_version webgpu=$WEBGPU_EP nudenet=$NUDENET $(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "creating $venv (onnxruntime $ort_version)"
  "$py" -m venv "$venv"
  quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
  # ortcapture depends on no ORT distribution (onnxruntime and onnxruntime-gpu are one package): name one here.
  # An onnxruntime-gpu already in the venv is kept (installing onnxruntime would overwrite its files).
  ort_req="onnxruntime==$ort_version"
  if gpu=$("$venv/bin/python" -m pip show onnxruntime-gpu 2>/dev/null | sed -n 's/^Version: //p') && [ -n "$gpu" ]; then
    log "keeping onnxruntime-gpu $gpu in $venv (not installing onnxruntime $ort_version)"
    ort_req=""
  fi
  extras=test,bench,webgpu
  # tools/test.sh builds the API reference there only; Ray Serve and tritonclient (the serving tests' server and
  # client) are large and serving does not depend on the ORT version: the older venvs skip the serving tests
  if [ "$venv" = "$root/.venv" ]; then extras=$extras,docs,serve-test; fi
  quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check $ort_req \
    "onnxruntime-ep-webgpu==$WEBGPU_EP; python_version >= '3.11'" -e "$root[$extras]"
  # a library that builds its own ORT sessions, for the patch_onnxruntime example; its onnxruntime requirement is
  # not installed (it would replace the ORT distribution chosen above)
  quiet_pip "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nudenet==$NUDENET" \
    opencv-python-headless
  echo "$want" > "$stamp"
else
  log "reusing $venv (onnxruntime $ort_version)"
fi
echo "$venv"
webgpu_env
