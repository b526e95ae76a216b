#!/usr/bin/env bash
# Stage Ray Serve + tritonclient (+ matplotlib for the plot) for the H200 device machine (no network there), in
# parts of < 58 MiB: .gpu/s0, .gpu/s1, ... (one device call carries one part; the ray wheel itself is split).
# The H200 has Python 3.12 (/opt/torch/.venv) with torch, numpy, cuda-python, cupy, onnx and pytest: those and their
# dependencies that could clash when shadowed (numpy, torch, nvidia-*, triton, onnx, protobuf, ml_dtypes, cupy,
# cuda-*, sympy, mpmath, networkx, jinja2, MarkupSafe, fsspec, pytest, pluggy, iniconfig, pygments, setuptools)
# are not shipped; everything else is, into /tmp/site_serve (not ORT's /tmp/site).
# Run from the project root. Usage: tools/stage_serving.sh   (prints the device calls)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/ortcapture-stage/serving"
mkdir -p "$cache"
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any \
  -d "$cache" "ray[serve]>=2.40" "tritonclient[http]>=2.40" "matplotlib>=3.7" >&2
skip='^(numpy|torch|triton|nvidia_|onnx|protobuf|ml_dtypes|cupy|fastrlock|cuda_|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|pytest|pluggy|iniconfig|pygments|setuptools)-'
rm -rf .gpu/s[0-9]*
mkdir -p .gpu/stmp
limit=$((56 * 1024 * 1024))  # < 58 MiB a part (the working tree, ~2 MiB, travels with it in one 64 MiB call)
n=0; used=0; mkdir -p .gpu/s0
add() {  # add FILE to the current part, opening a new one when it would pass the limit
  local f=$1 size
  size=$(stat -c %s "$f")
  if [ $((used + size)) -gt $limit ] && [ $used -gt 0 ]; then n=$((n + 1)); used=0; mkdir -p ".gpu/s$n"; fi
  cp "$f" ".gpu/s$n/"; used=$((used + size))
}
wheels=()
for whl in "$cache"/*.whl; do
  base=$(basename "$whl")
  if echo "$base" | grep -qiE "$skip"; then continue; fi
  wheels+=("$base")
  size=$(stat -c %s "$whl")
  if [ "$size" -gt $limit ]; then  # the ray wheel: split into pieces, each its own part
    split -b $((50 * 1024 * 1024)) -d "$whl" ".gpu/stmp/$base.part"
    for piece in .gpu/stmp/"$base".part*; do
      if [ $used -gt 0 ]; then n=$((n + 1)); used=0; mkdir -p ".gpu/s$n"; fi
      mv "$piece" ".gpu/s$n/"; used=$(stat -c %s ".gpu/s$n/$(basename "$piece")")
    done
  else
    add "$whl"
  fi
done
rmdir .gpu/stmp
echo "staged ${#wheels[@]} wheels in $((n + 1)) parts (.gpu/s0 .. .gpu/s$n):"
du -sh .gpu/s[0-9]* | sed 's/^/  /'
echo
echo "device calls (kind nvidia-h200; each carries one part; the machine must stay warm between them):"
for i in $(seq 0 "$n"); do
  echo "call $((i + 1)): carry [\".gpu/s$i\"]  command: mkdir -p /tmp/ss && cp .gpu/s$i/* /tmp/ss/ && ls /tmp/ss | wc -l"
done
echo "then (with the bench call, or alone):"
echo "  cd /tmp/ss && for p in \$(ls *.part00 2>/dev/null); do w=\${p%.part00}; cat \"\$w\".part* > \"\$w\" && rm \"\$w\".part*; done && cd - >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_serve /tmp/ss/*.whl && export PYTHONPATH=/tmp/site:/tmp/site_serve:\$PWD"
