#!/usr/bin/env bash
# README command 2: set everything up and run the test suite against the newest and the oldest supported
# onnxruntime, plus 1.27.0 (the first whose WebGPU plugin EP captures): CPU unit tests and real WebGPU capture
# on the software adapter; CUDA tests skip without a GPU. Once, in the newest-ORT environment: ruff, the import
# contracts, and the API reference with its docstring coverage (tools/docs.sh); once (with the first version): a GPU
# user's venv without CUDA libraries (tools/bootstrap.sh --gpu-nocuda) and the pip resolution of the [cuda] extras.
# Extra arguments go to pytest. ORTCAPTURE_ORT_VERSIONS="1.32.0" limits the matrix.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
versions=${ORTCAPTURE_ORT_VERSIONS:-"1.32.0 1.27.0 1.24.4"}
status=0
lint_done=0
docs_done=0
summary=()  # one line per step, printed together at the end
logdir=.cache/test-logs  # each ORT version's whole pytest output (git-ignored; replaced by the next run)
rm -rf "$logdir" && mkdir -p "$logdir"
color=no
[ -t 1 ] && color=yes
skip_line=$'^(\x1b\\[[0-9;]*m)*SKIPPED(\x1b\\[[0-9;]*m)* \\['  # pytest's "SKIPPED [n] file:line: why", coloured or not
for v in $versions; do
  { read -r venv; read -r env_file; } < <(bash tools/bootstrap.sh --ort "$v")
  echo "=== onnxruntime $v ($venv) ==="
  once=""
  if [ $lint_done = 0 ]; then  # the architecture's contracts (once): layers, and no reaching into private members
    lint_done=1
    echo "=== once: ruff, import contracts, a GPU user's venv without CUDA ==="
    if "$venv/bin/ruff" check ortcapture benchmarks; then summary+=("ruff: passed"); else status=1; summary+=("ruff: FAILED"); fi
    if "$venv/bin/lint-imports" .importlinter; then summary+=("import contracts: kept"); else status=1; summary+=("import contracts: BROKEN"); fi
    # once, not per ORT version: a GPU user's venv without CUDA (tests/test_gpu_nocuda.py) and the pip resolution
    # of the [cuda] extras (tests/test_gpu_extras.py)
    once=$(bash tools/bootstrap.sh --gpu-nocuda) || { status=1; summary+=("GPU user's venv without CUDA (bootstrap --gpu-nocuda): FAILED"); }
    once=${once%%$'\n'*}  # its first line: the venv
  fi
  if [ $docs_done = 0 ] && [ "$venv" = "$root/.venv" ]; then  # the API reference (once: .venv has the docs extra)
    docs_done=1
    echo "=== once: API reference and docstring coverage (tools/docs.sh) ==="
    if bash tools/docs.sh "$venv"; then summary+=("API reference and docstring coverage: passed"); else status=1; summary+=("API reference and docstring coverage: FAILED"); fi
  fi
  (
    [ -n "$env_file" ] && source "$env_file"
    if [ -n "$once" ]; then export ORTCAPTURE_NOCUDA_VENV=$once ORTCAPTURE_PIP_RESOLVE=1; fi
    # WebGPU must really run here: a missing adapter fails the WebGPU tests instead of skipping them.
    export ORTCAPTURE_REQUIRE_WEBGPU=${ORTCAPTURE_REQUIRE_WEBGPU:-1}
    # The serving tests (Ray Serve + tritonclient, installed for the newest ORT only) must really run there: a
    # missing ray fails them instead of skipping them; the older venvs skip them.
    if [ "$v" = "$(sed -n 's/^NEWEST_ORT=//p' tools/bootstrap.sh)" ]; then
      export ORTCAPTURE_REQUIRE_SERVE=${ORTCAPTURE_REQUIRE_SERVE:-1}
    else
      export ORTCAPTURE_REQUIRE_SERVE=0
    fi
    echo "=== onnxruntime $v: pytest ==="
    # Dawn's "WebGPU device error" lines, by the test whose output held them (tests/conftest.py): none in a good run
    export ORTCAPTURE_DEVICE_ERROR_LOG="$root/$logdir/webgpu-device-errors-$v.txt"
    rm -f "$ORTCAPTURE_DEVICE_ERROR_LOG"
    # every skip's reason goes to the log; the console gets their count (1,000 lines of "CUDA EP unavailable" buried
    # the failures a fresh user looks for)
    "$venv/bin/python" -m pytest -q -rfEs -p no:cacheprovider --color=$color "$@" | tee "$logdir/pytest-$v.txt" \
      | grep -Ev "$skip_line"
  ) || status=1
  skips=$(grep -Ec "$skip_line" "$logdir/pytest-$v.txt" 2>/dev/null || true)
  [ "${skips:-0}" -gt 0 ] && echo "($skips skip reasons, one line per test location: $logdir/pytest-$v.txt)"
  # pytest's own last line: "N passed, M skipped ... in T s" (or why it stopped)
  last=$(grep -v '^[[:space:]]*$' "$logdir/pytest-$v.txt" 2>/dev/null | tail -n 1 | sed 's/\x1b\[[0-9;]*m//g; s/^=* *//; s/ *=*$//' || true)
  summary+=("onnxruntime $v: ${last:-no pytest summary}")
  deverr="$logdir/webgpu-device-errors-$v.txt"
  if [ -s "$deverr" ]; then
    echo "WebGPU device errors (onnxruntime $v), by test:"; cat "$deverr"
    summary+=("onnxruntime $v: WebGPU device errors in $(wc -l < "$deverr") test(s), listed above ($deverr)")
  fi
done
[ $docs_done = 1 ] || summary+=("docs: not built (only in .venv, the onnxruntime $(sed -n 's/^NEWEST_ORT=//p' tools/bootstrap.sh) environment)")
echo
echo "=== summary ($( [ $status = 0 ] && echo "all passed" || echo "FAILED" ))"
for line in "${summary[@]}"; do echo "  $line"; done
exit $status
