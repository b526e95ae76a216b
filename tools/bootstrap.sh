#!/usr/bin/env bash
# Create (or reuse) a virtual environment with ortcapture (editable, extras test, bench, webgpu; docs in .venv), the pinned
# onnxruntime and WebGPU plugin EP, and set up software WebGPU on machines without a GPU. Idempotent.
#
# Usage: tools/bootstrap.sh [--ort VERSION] [--venv DIR]
#   --ort   onnxruntime version to install (default: the newest supported, 1.32.0)
#   --venv  where to create the environment (default: .venv, or .venv-ort<VERSION> for other versions)
# stdout: two lines, the venv directory and the WebGPU env file to source (empty when WebGPU set-up failed).
set -euo pipefail
NEWEST_ORT=1.32.0
WEBGPU_EP=0.4.0
root=$(cd "$(dirname "$0")/.." && pwd)
ort_version=$NEWEST_ORT
venv=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ort) ort_version=$2; shift 2 ;;
    --venv) venv=$2; shift 2 ;;
    *) echo "bootstrap: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$venv" ]; then
  if [ "$ort_version" = "$NEWEST_ORT" ]; then venv="$root/.venv"; else venv="$root/.venv-ort$ort_version"; fi
fi
log() { echo "bootstrap: $*" >&2; }
py=${PYTHON:-python3}
stamp="$venv/.ortcapture-stamp"
NUDENET=3.4.2  # the end-to-end library example (tests/test_library_example.py); --no-deps: it requires onnxruntime
want="ort=$ort_version webgpu=$WEBGPU_EP nudenet=$NUDENET $(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "creating $venv (onnxruntime $ort_version)"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
  # ortcapture depends on no ORT distribution (onnxruntime and onnxruntime-gpu are one package): name one here.
  # An onnxruntime-gpu already in the venv is kept (installing onnxruntime would overwrite its files).
  ort_req="onnxruntime==$ort_version"
  if gpu=$("$venv/bin/python" -m pip show onnxruntime-gpu 2>/dev/null | sed -n 's/^Version: //p') && [ -n "$gpu" ]; then
    log "keeping onnxruntime-gpu $gpu in $venv (not installing onnxruntime $ort_version)"
    ort_req=""
  fi
  extras=test,bench,webgpu
  if [ "$venv" = "$root/.venv" ]; then extras=$extras,docs; fi  # tools/test.sh builds the reference there only
  "$venv/bin/python" -m pip install -q --disable-pip-version-check $ort_req \
    "onnxruntime-ep-webgpu==$WEBGPU_EP; python_version >= '3.11'" -e "$root[$extras]" >&2
  # a library that builds its own ORT sessions, for the patch_onnxruntime example; its onnxruntime requirement is
  # not installed (it would replace the ORT distribution chosen above)
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nudenet==$NUDENET" \
    opencv-python-headless >&2
  echo "$want" > "$stamp"
else
  log "reusing $venv (onnxruntime $ort_version)"
fi
env_file=""
if env_file=$(bash "$root/tools/setup_webgpu.sh"); then :; else
  log "WebGPU software adapter set-up failed; WebGPU tests will fail"
  env_file=""
fi
echo "$venv"
echo "$env_file"
