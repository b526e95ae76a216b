#!/usr/bin/env bash
# On the device machine, from the repository root: unpack what tools/stage_device.sh staged (/tmp/z/all.tar.part*:
# onnxruntime-gpu into /tmp/site, the serving wheels into /tmp/site_serve, the models under /tmp/zx/.models), then
# the GPU work, step by step, each bounded in time, its output in $OUT/STEP.txt (and the tail here).
# STEPS (default "tests serving served arms"): tests (the CUDA tests of the page-locked paths, buckets, CUDA),
# serving (bench_serving's arms at 1/8/32 clients + py-spy at 32), served (the served CUDA shared-memory tests),
# arms (bucket_arms, TF32 on), suite (every CUDA test), bench (ortcapture bench at batch 1 and 8), haproxy
# (tools/serve_smoke.sh --haproxy: ortcapture serve under Ray Serve's HAProxy ingress, answers checked, SIGINT),
# protocols (bench_serving's PROTO_ARMS, default product, over PATHS, default http,grpc,shm,cudashm,http-shm,http-cudashm, at LEVELS, default
# 1,32; SPY=1: py-spy records the tier and session replicas at 32 clients on every path, or on SPY_PATHS; with
# PY_SPY_NATIVE=1 native frames too; PLAIN_RUNS, default 50),
# pytest (python3 -m pytest $PYTEST_ARGS).
set -u
t0=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/zx/.models ]; then
  mkdir -p /tmp/zx && cat /tmp/z/all.tar.part* | tar -xf - -C /tmp/zx || { echo "unpack failed"; exit 3; }
  rm -f /tmp/z/all.tar.part*
fi
[ -d /tmp/site/onnxruntime ] || { mkdir -p /tmp/site && cat /tmp/zx/.gpu/x*/ort.tar.xz.part* | tar -xJf - -C /tmp/site; } \
  || { echo "ORT extract failed"; exit 3; }
if [ ! -d /tmp/site_serve/ray ]; then
  mkdir -p /tmp/ss && cp /tmp/zx/.gpu/s*/* /tmp/ss/
  (cd /tmp/ss && for p in $(ls *.part00 2>/dev/null); do w=${p%.part00}; cat "$w".part* > "$w" && rm "$w".part*; done)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_serve /tmp/ss/*.whl \
    || echo "serving install failed"
fi
[ -e .models ] || ln -s /tmp/zx/.models .models
export PYTHONPATH=/tmp/site:/tmp/site_serve:$PWD ORTCAPTURE_CACHE=$PWD/.models PYTHONUNBUFFERED=1 PATH=/tmp/site_serve/bin:$PATH
step() { local name=$1 t=$2; shift 2; echo "=== $name $(date +%T)"; timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
         grep -v "Pydantic\|= Field(" "$OUT/$name.txt" | tail -n "${TAILN:-25}"; echo "=== $name rc=$rc $(date +%T)"; }
echo "ready in $(( $(date +%s) - t0 )) s; commit $(cat .gpu/commit.txt 2>/dev/null)"; nvidia-smi -L
python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())'
for s in ${STEPS:-tests serving served arms}; do case $s in
tests) step cuda_tests "${TESTS_LIMIT:-130}" python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_pinned_host.py \
         tests/test_output_arena.py tests/test_staging.py tests/test_buckets.py tests/test_cuda.py ;;
serving) TAILN=30 step serving "${SERVING_LIMIT:-240}" python3 benchmarks/bench_serving.py \
           --arms "${ARMS:-noop4,hand-buckets,product,product-noreg}" --levels "${LEVELS:-1,8,32}" --paths handle \
           --repeats 1 --seconds 3 --warm 1 --plain-runs 100 --py-spy-level 32 --py-spy-bin "$(command -v py-spy)" \
           --out "$OUT/serving"
         tar -C "$OUT" -cJf "$OUT/serving.tar.xz" serving && rm -rf "$OUT/serving" ;;
served) ORTCAPTURE_SERVE_TEST_PROVIDER=cuda step served_cuda "${SERVED_LIMIT:-75}" python3 -m pytest -q -p no:cacheprovider \
          -rs tests/test_serving_cuda_shm.py ;;
arms) step bucket_arms "${ARMS_LIMIT:-60}" python3 benchmarks/bucket_arms.py --provider cuda --model reference --tf32 1 \
        --iters 150 --out "$OUT/bucket_arms_tf32.json" ;;
suite) step cuda_suite "${SUITE_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -m cuda -rs \
         --continue-on-collection-errors tests/ --ignore=tests/test_patch.py ;;
bench) step bench "${BENCH_LIMIT:-110}" python3 -m ortcapture bench --provider cuda --batch 1,8 --procs 3 --iters 200 \
         --json "$OUT/bench_cli.json" ;;
haproxy) TAILN=30 step haproxy "${HAPROXY_LIMIT:-200}" bash tools/serve_smoke.sh --haproxy ;;
protocols) TAILN=12 step protocols "${PROTOCOLS_LIMIT:-320}" python3 benchmarks/bench_serving.py --arms "${PROTO_ARMS:-product}" \
             --levels "${LEVELS:-1,32}" --paths "${PATHS:-http,grpc,shm,cudashm,http-shm,http-cudashm}" --repeats 1 --seconds 3 --warm 1 \
             --plain-runs "${PLAIN_RUNS:-50}" ${SPY:+--py-spy-level 32 --py-spy-paths "${SPY_PATHS:-${PATHS:-http,grpc,shm,cudashm,http-shm,http-cudashm}}"} \
             --py-spy-bin "$(command -v py-spy)" --out "$OUT/protocols"
           tar -C "$OUT" -cJf "$OUT/protocols.tar.xz" protocols && rm -rf "$OUT/protocols" ;;
pytest) step pytest "${PYTEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-tests} ;;
*) echo "unknown step $s" ;;
esac; done
ls -la "$OUT"; echo "total $(( $(date +%s) - t0 )) s"
