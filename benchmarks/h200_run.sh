#!/usr/bin/env bash
# The GPU run on the H200 device machine (shared/DEVICE.md), from the repository root: CUDA suite, demo at batch 1
# and 8, overhead benchmark, then the WebGPU suite and demo on the real GPU through Vulkan. Results go to $OUT.
# Expects onnxruntime-gpu installed in /tmp/site (staged with shared/tools/stage-ort-gpu.sh), .whl (the WebGPU
# plugin wheel), .gl (Vulkan/GL loader debs) and .models (ORTCAPTURE_CACHE holding the reference model).
# Steps (STEPS="..."; benchmarks/README.md says which numbers each one gave): see the `has` lines below.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ORTCAPTURE_CACHE=$PWD/.models
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
export ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1
nvidia-smi -L | tee -a "$OUT/log.txt"
python3 -c 'import onnxruntime as o, torch; print("onnxruntime", o.__version__, o.get_available_providers(), "torch", torch.__version__, torch.cuda.device_count())' | tee -a "$OUT/log.txt"
step() { local name=$1 t=$2; shift 2; echo "=== $name"; timeout "$t" "$@" 2>&1 | grep -v "XDG_RUNTIME\|maxDynamic" | tee -a "$OUT/log.txt"; echo "=== $name rc=${PIPESTATUS[0]}"; }
STEPS=${STEPS:-"pytest demo1 demo8 bench bench_cli doctor demo_webgpu"}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# test_patch needs git/patch trees and unidiff, not a GPU: it runs in CI
has pytest && step pytest 480 python3 -m pytest -q -p no:cacheprovider -rs tests/ --ignore=tests/test_patch.py
has demo1 && step demo1 90 python3 -m ortcapture demo --provider cuda --batch 1 --iters 300 --json "$OUT/demo1.json"
has demo8 && step demo8 90 python3 -m ortcapture demo --provider cuda --batch 8 --iters 200 --json "$OUT/demo8.json"
has bench && step bench 120 python3 benchmarks/bench_overhead.py --provider cuda --iters 300 --rounds 5 --json "$OUT/bench.json"
has bench_cli && step bench_cli 300 python3 -m ortcapture bench --provider cuda --batch 1,8 --procs 5 --iters 300 --json "$OUT/bench_cli.json" --plot "$OUT/bench_cli.png"
B="python3 -m ortcapture bench --provider cuda --batch 1,8"
has bench_sync && step bench_sync 300 $B --procs 5 --iters 300 --sync device --json "$OUT/bench_sync.json" --plot "$OUT/bench_sync.png"
HOST="--intra-op-threads 1 --session-config session.intra_op.allow_spinning=0 --pin-thread"
has bench_host && step bench_host 300 $B --procs 5 --iters 300 --sync device $HOST --json "$OUT/bench_host.json" --plot "$OUT/bench_host.png"
has bench_host_rb && step bench_host_rb 300 $B --procs 5 --iters 300 $HOST --json "$OUT/bench_host_rb.json" --plot "$OUT/bench_host_rb.png"
has pytest_bench && step pytest_bench 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_bench.py
has bench_nhwc && step bench_nhwc 300 $B --procs 5 --iters 300 --sync device --provider-option prefer_nhwc=1 --json "$OUT/bench_nhwc.json" --plot "$OUT/bench_nhwc.png"
has bench_nhwc_rb && step bench_nhwc_rb 300 $B --procs 5 --iters 300 --provider-option prefer_nhwc=1 --json "$OUT/bench_nhwc_rb.json" --plot "$OUT/bench_nhwc_rb.png"
has doctor && step doctor 120 python3 -m ortcapture doctor "$ORTCAPTURE_CACHE/models/nudenet-3.4.2/320n.onnx" --provider cuda --json
# issue 32: replay hot path and host staging, old code (.baseline/ortcapture = git archive 014dc30 ortcapture) vs new
has profile_replay && step profile_replay 590 python3 benchmarks/profile_replay.py --provider cuda --baseline .baseline --procs 5 --cases tiny,yolo1 --out "$OUT/profile_replay_small.json"
has profile_replay && step profile_replay_b8 590 python3 benchmarks/profile_replay.py --provider cuda --baseline .baseline --procs 5 --cases yolo8,affine8 --out "$OUT/profile_replay_b8.json"
has pytest_staging && step pytest_staging 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_staging.py tests/test_cuda.py tests/test_capture.py tests/test_transfer.py tests/test_architecture.py
has capture_probe && step capture_probe 120 python3 benchmarks/bench_capture_probe.py --json "$OUT/capture_probe.json"
has profile && step profile 200 python3 benchmarks/profile_gpu.py --json "$OUT/profile_gpu.json"
has bench_multi && step bench_multi 180 python3 benchmarks/bench_multi_gpu.py --iters 300 --json "$OUT/bench_multi_gpu.json"
# ORT's own Python tests (carried in the git-ignored .ort_tests/): raw ORT vs ortcapture installed
has conformance && step conformance 300 python3 benchmarks/ort_conformance.py --tests .ort_tests --json "$OUT/conformance.json"
# issue 42: buckets against g.run on CUDA (same/new arrays, mixed stream, a padded request's steps)
has bucket_arms && step bucket_arms 150 python3 benchmarks/bucket_arms.py --provider cuda --model reference --out "$OUT/bucket_arms.json"
# issue 44: serving against hand-written Ray Serve (needs tools/stage_serving.sh's wheels installed in /tmp/site_serve)
has serving44 && PYTHONPATH=/tmp/site:/tmp/site_serve:$PWD step serving44 ${SERVING_LIMIT:-560} python3 benchmarks/bench_serving.py \
  --arms ${SERVING_ARMS:-noop1,noop4,hand-buckets,hand-padded,product,product-tput} --levels ${SERVING_LEVELS:-1,8,32,64} \
  --paths ${SERVING_PATHS:-handle,http,grpc,shm} --repeats ${SERVING_REPEATS:-1} --seconds 3 --out "$OUT"
has demo_webgpu && step demo_webgpu 120 python3 -m ortcapture demo --provider webgpu --batch 1 --iters 100 --json "$OUT/demo_webgpu.json"
exit 0
