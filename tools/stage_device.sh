#!/usr/bin/env bash
# Stage everything a GPU run needs — onnxruntime-gpu (tools/stage_ort_xz.sh), Ray Serve and the test extras
# (tools/stage_serving.sh), the reference and sequence models — as ONE tar cut into parts that each fit a device call
# with the working tree (64 MiB in all): .gpu/z0 .. .gpu/zN (~6 parts). Then tools/device_run.sh, carried with the
# last part, unpacks it on the device machine and runs the GPU work. Run from the repository root.
# Usage: tools/stage_device.sh [ORT_VERSION]   (default 1.31.1; the parts before are reused when present)
set -euo pipefail
ver="${1:-1.31.1}"
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude  # never committed or carried whole
[ -d .gpu/x0 ] || bash tools/stage_ort_xz.sh "$ver" >/dev/null
[ -d .gpu/s0 ] || bash tools/stage_serving.sh >/dev/null
py=${PYTHON:-.venv/bin/python}
ORTCAPTURE_CACHE="$root/.models" "$py" -c "from ortcapture.cli import models; models.reference_model(); models.sequence_model()"
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
part=$(( (60 << 20) - tree ))  # room left in a 64 MiB call, 4 MiB spare
source tools/split_parts.sh
split_parts "$part" .gpu/z all.tar < <(tar -cf - .gpu/x[0-9]* .gpu/s[0-9]* .models)
n=$PARTS
git rev-parse --short HEAD > .gpu/commit.txt
echo "staged in $n parts (.gpu/z0 .. .gpu/z$((n - 1))), $((part >> 20)) MiB each at most:"
du -sh .gpu/z[0-9]* | sed 's/^/  /'
print_calls .gpu/z 0 $((n - 2)) /tmp/z
echo "call $n: carry [\".gpu/z$((n - 1))\", \".gpu/commit.txt\"]  command: mkdir -p /tmp/z && cp .gpu/z$((n - 1))/* /tmp/z/ && bash tools/device_run.sh"
echo "(calls right after each other: the machine is given back 30 s after a call; later warm calls: STEPS=... bash tools/device_run.sh)"
