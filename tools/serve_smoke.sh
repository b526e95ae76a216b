#!/usr/bin/env bash
# ortcapture serve end to end on this machine, with extra serve flags (e.g. --haproxy): start it on loopback, one
# HTTP (binary) and one gRPC request of 3 rows checked against the CPU EP (within 1e-2 of the output's largest value:
# TF32), then SIGINT; prints how long each step took, the server's log tail, and the batch slots left in /dev/shm
# (none expected); exit 1 when the URL never came, an answer is wrong or missing, the server outlives SIGINT by 80 s
# or a batch slot is left. Run from the repository root with ortcapture, Ray Serve and tritonclient importable
# (tools/device_run.sh's STEPS=haproxy runs it with --haproxy on the GPU machine; never in CI: Ray's HAProxy binds
# its stats and metrics ports on every interface). Usage: tools/serve_smoke.sh [SERVE FLAGS...]
set -u
py=${PYTHON:-python3}
M=$("$py" -c "from ortcapture.cli import models; print(models.reference_model())") || exit 3
log=$(mktemp -d)
t0=$(date +%s)
timeout 170 "$py" -m ortcapture serve "$M" --port 8123 --grpc-port 8124 --dim height=320 --dim width=320 "$@" \
  > "$log/out" 2> "$log/err" &
srv=$!  # timeout's pid: the server is its child
alive() { local st; st=$(ps -o stat= -p "$srv" 2> /dev/null); [ -n "$st" ] && [ "${st#Z}" = "$st" ]; }  # not a zombie
bad=0
for _ in $(seq 120); do grep -q http "$log/out" && break; sleep 1; done
echo "stdout: $(cat "$log/out") after $(( $(date +%s) - t0 )) s"
grep -q http "$log/out" || bad=1
"$py" - "$M" <<'PY'
import sys

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as g
import tritonclient.http as h

x = np.random.default_rng(0).random((3, 3, 320, 320), dtype=np.float32)
so = ort.SessionOptions()
for d in ("height", "width"):
    so.add_free_dimension_override_by_name(d, 320)
ref = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"]).run(None, {"images": x})[0]
i = h.InferInput("images", x.shape, "FP32")
i.set_data_from_numpy(x, binary_data=True)
a = h.InferenceServerClient("127.0.0.1:8123").infer("320n", [i]).as_numpy("output0")
j = g.InferInput("images", x.shape, "FP32")
j.set_data_from_numpy(x)
b = g.InferenceServerClient("127.0.0.1:8124").infer("320n", [j]).as_numpy("output0")
tol = 1e-2 * float(np.abs(ref).max())
worst = max(float(np.abs(a - ref).max()), float(np.abs(b - ref).max()))
print(f"HTTP and gRPC answers {a.shape}: max abs diff against the CPU EP {worst:.4g} (tolerance {tol:.4g}):",
      "OK" if worst <= tol else "WRONG")
sys.exit(0 if worst <= tol else 1)
PY
[ $? -eq 0 ] || bad=1
echo "batch slots while serving: $(ls /dev/shm | grep -c ortcapture)"
pkill -INT -P "$srv"  # this script's server only
t1=$(date +%s)
for _ in $(seq 80); do alive || break; sleep 1; done
if alive; then echo "still running 80 s after SIGINT"; bad=1; kill -TERM "$srv"; fi
echo "stopped in $(( $(date +%s) - t1 )) s"
grep -v "Pydantic\|Field(" "$log/err" | tail -n 12
left=$(ls /dev/shm | grep -c ortcapture)
echo "batch slots left in /dev/shm: $left"
[ "$left" -eq 0 ] || bad=1
rm -rf "$log"
exit "$bad"
