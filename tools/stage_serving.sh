#!/usr/bin/env bash
# Stage Ray Serve + tritonclient (+ hypothesis for the tests; matplotlib for the plot with STAGE_PLOT=1) for the H200 device machine (no
# network there), in parts of < 58 MiB: .gpu/s0, .gpu/s1, ... (one device call carries one part; the ray wheel itself is split).
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
  -d "$cache" "ray[serve]>=2.40" "tritonclient[http]>=2.40" "matplotlib>=3.7" "hypothesis>=6" >&2
# the plot stack (~25 MiB) is shipped only with STAGE_PLOT=1: bench_serving's JSON plots on any machine (its _plot)
plot='|matplotlib|pillow|fonttools|kiwisolver|contourpy|cycler'
[ "${STAGE_PLOT:-0}" = 1 ] && plot=''
skip='^(numpy|torch|triton|nvidia_|onnx|protobuf|ml_dtypes|cupy|fastrlock|cuda_|sympy|mpmath|networkx|jinja2|markupsafe|fsspec|pytest|pluggy|iniconfig|pygments|setuptools'"$plot"')-'
rm -rf .gpu/s[0-9]* .gpu/stmp
mkdir -p .gpu/stmp
# the wheels to ship (the ray wheel cut into 50 MiB pieces), packed first-fit-decreasing into parts of < 58 MiB
# (the working tree, ~2 MiB, travels with a part in one 64 MiB call)
for whl in "$cache"/*.whl; do
  base=$(basename "$whl")
  if echo "$base" | grep -qiE "$skip"; then continue; fi
  if echo "$base" | grep -q '^ray-'; then  # Ray's wheel without its Java jar (31 MiB) and source maps: 79 -> 45 MiB
    python3 - "$whl" ".gpu/stmp/$base" <<'PY'
import sys, zipfile
src, dst = zipfile.ZipFile(sys.argv[1]), zipfile.ZipFile(sys.argv[2], "w", zipfile.ZIP_DEFLATED)
for i in src.infolist():
    if not (i.filename.startswith("ray/jars/") or i.filename.endswith(".js.map")):
        dst.writestr(i, src.read(i.filename), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
dst.close()
PY
    continue
  fi
  if [ "$(stat -c %s "$whl")" -gt $((50 * 1024 * 1024)) ]; then
    split -b $((50 * 1024 * 1024)) -d "$whl" ".gpu/stmp/$base.part"
  else
    ln -s "$whl" ".gpu/stmp/$base"
  fi
done
n=$(python3 - <<'PY'
import os, shutil
limit = 56 * 1024 * 1024
files = sorted(os.listdir(".gpu/stmp"), key=lambda f: -os.path.getsize(os.path.join(".gpu/stmp", f)))
parts = []  # [bytes used, [files]]
for f in files:
    size = os.path.getsize(os.path.join(".gpu/stmp", f))
    part = next((p for p in parts if p[0] + size <= limit), None)
    if part is None:
        part = [0, []]
        parts.append(part)
    part[0] += size
    part[1].append(f)
for i, (_, fs) in enumerate(parts):
    os.makedirs(f".gpu/s{i}")
    for f in fs:
        shutil.copyfile(os.path.join(".gpu/stmp", f), f".gpu/s{i}/{f}")  # follows the links to the cache
print(len(parts) - 1)
PY
)
wheels=($(ls .gpu/stmp | sed 's/\.part[0-9]*$//' | sort -u))
rm -rf .gpu/stmp
echo "staged ${#wheels[@]} wheels in $((n + 1)) parts (.gpu/s0 .. .gpu/s$n):"
du -sh .gpu/s[0-9]* | sed 's/^/  /'
echo
echo "device calls (kind nvidia-h200; each carries one part; the machine must stay warm between them):"
for i in $(seq 0 "$n"); do
  echo "call $((i + 1)): carry [\".gpu/s$i\"]  command: mkdir -p /tmp/ss && cp .gpu/s$i/* /tmp/ss/ && ls /tmp/ss | wc -l"
done
echo "then (with the bench call, or alone):"
echo "  cd /tmp/ss && for p in \$(ls *.part00 2>/dev/null); do w=\${p%.part00}; cat \"\$w\".part* > \"\$w\" && rm \"\$w\".part*; done && cd - >/dev/null && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_serve /tmp/ss/*.whl && export PYTHONPATH=/tmp/site:/tmp/site_serve:\$PWD"
