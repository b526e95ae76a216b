#!/usr/bin/env bash
# README command 1: set everything up and run the demo on the best available provider
# (CUDA with onnxruntime-gpu where a GPU is, else WebGPU on the software adapter). Arguments go to `ortcapture demo`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
{ read -r venv; read -r env_file; } < <(bash "$root/tools/bootstrap.sh")
[ -n "$env_file" ] && source "$env_file"
exec "$venv/bin/ortcapture" demo "$@"
