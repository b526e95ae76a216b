#!/usr/bin/env bash
# Stage onnxruntime-gpu for the device machine in 4 transfers instead of shared/tools/stage-ort-gpu.sh's 5: the wheel
# unpacked and packed as an xz tar (244 MiB wheel -> 194 MiB), cut into 58 MiB parts .gpu/x0 .. .gpu/x3 (the last one
# leaves room for models and scripts in the same call). Run from the repository root; prints the device calls.
# Usage: tools/stage_ort_xz.sh [VERSION]   (default 1.31.1; the wheel is downloaded by shared/tools/stage-ort-gpu.sh's
# cache, ~/.cache/ortcapture-stage/VERSION, or here)
set -euo pipefail
ver="${1:-1.31.1}"
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ortcapture-stage/$ver"
mkdir -p "$cache"
whl=$(ls "$cache"/onnxruntime_gpu-"$ver"-cp312-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$whl" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$cache" "onnxruntime-gpu==$ver"
  whl=$(ls "$cache"/onnxruntime_gpu-"$ver"-cp312-*.whl | head -n1)
fi
tar="$cache/ort-$ver.tar.xz"
if [ ! -s "$tar" ]; then
  tmp=$(mktemp -d)
  python3 -m zipfile -e "$whl" "$tmp/site"
  tar -C "$tmp/site" -cf - . | xz -9 -T0 > "$tar.tmp" && mv "$tar.tmp" "$tar"
  rm -rf "$tmp"
fi
source tools/split_parts.sh
split_parts 58M .gpu/x ort.tar.xz < "$tar"
n=$PARTS
echo "onnxruntime-gpu $ver as $n parts (.gpu/x0 .. .gpu/x$((n - 1))):"
du -sh .gpu/x[0-9]* | sed 's/^/  /'
print_calls .gpu/x 0 $((n - 1)) /tmp/og
echo "then, in the last call or after it: mkdir -p /tmp/site && cat /tmp/og/ort.tar.xz.part* | tar -xJf - -C /tmp/site && export PYTHONPATH=/tmp/site:\$PWD"
