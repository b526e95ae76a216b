#!/usr/bin/env python3
"""What one request costs the *client* in CPU, per Triton client library (issue 45: why gRPC trails HTTP when the
clients share the server's machine, as in ``bench_serving.py``), timed in alternating blocks in one process
(``benchmarks/paired.py``), no server.

The request is the reference model's: one 1.2 MB float32 image in, ``output0`` of (1, 22, 2100) float32 back. Arms
(median µs per request over ``--iters`` calls each):

* ``request``: building the request as each client's ``infer`` does before sending — ``tritonclient.http``: an
  ``InferInput`` with ``set_data_from_numpy(binary_data=True)`` and the body
  (``InferenceServerClient.generate_request_body``); ``tritonclient.grpc``: an ``InferInput`` with
  ``set_data_from_numpy``, the ``ModelInferRequest`` (``tritonclient.grpc._utils._get_inference_request``, what its
  ``infer`` builds it with) and its
  ``SerializeToString()`` (what gRPC's channel calls to send it);
* ``response``: reading the answer's output as numpy — ``tritonclient.http``: ``InferResult.from_response_body`` of a
  binary-output body, then ``as_numpy``; ``tritonclient.grpc``: ``ModelInferResponse.FromString`` of the wire bytes
  (what gRPC's channel calls on receipt), then ``InferResult(...).as_numpy``.

Sending and receiving (sockets, HTTP/2 framing, gRPC's core) are not in these numbers.

Usage::

    python benchmarks/client_costs.py --iters 300 --out benchmarks/measured/cpu-client-costs-1207.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import paired  # noqa: E402 - benchmarks/paired.py, beside this file


def _compare(http_call, grpc_call, iters: int) -> dict:
    t_http, t_grpc = paired.time_blocks(http_call, grpc_call, iters)
    return {"http_us": round(statistics.median(t_http), 1), "grpc_us": round(statistics.median(t_grpc), 1),
            "grpc_over_http": round(paired.median_ratio(t_grpc, t_http), 2)}


def measure(iters: int) -> dict:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.grpc import _utils as grpc_utils
    from tritonclient.grpc import service_pb2

    rng = np.random.default_rng(0)
    x = rng.random((1, 3, 320, 320), dtype=np.float32)
    y = rng.random((1, 22, 2100), dtype=np.float32)

    def http_request():
        inp = httpclient.InferInput("images", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        out = httpclient.InferRequestedOutput("output0", binary_data=True)
        return httpclient.InferenceServerClient.generate_request_body([inp], outputs=[out])

    def grpc_request():
        inp = grpcclient.InferInput("images", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = grpcclient.InferRequestedOutput("output0")
        # tritonclient.grpc has no public request builder: this is the one its infer() calls
        return grpc_utils._get_inference_request(  # noqa: SLF001
            model_name="ref", inputs=[inp], model_version="", outputs=[out], parameters=None,
            request_id="", sequence_id=0, sequence_start=False, sequence_end=False, priority=0,
            timeout=None).SerializeToString()

    head = json.dumps({"model_name": "ref", "model_version": "1", "outputs": [
        {"name": "output0", "datatype": "FP32", "shape": list(y.shape),
         "parameters": {"binary_data_size": y.nbytes}}]}).encode()
    http_body = head + y.tobytes()
    res = service_pb2.ModelInferResponse(model_name="ref", model_version="1")
    res.outputs.add(name="output0", datatype="FP32", shape=list(y.shape))
    res.raw_output_contents.append(y.tobytes())
    grpc_wire = res.SerializeToString()

    def http_response():
        return httpclient.InferResult.from_response_body(http_body, header_length=len(head)).as_numpy("output0")

    def grpc_response():
        return grpcclient.InferResult(service_pb2.ModelInferResponse.FromString(grpc_wire)).as_numpy("output0")

    for a, b in ((http_response(), y), (grpc_response(), y)):  # both read the answer right
        np.testing.assert_array_equal(a, b)
    return {"request": _compare(http_request, grpc_request, iters), "response": _compare(http_response, grpc_response,
                                                                                     iters)}


if __name__ == "__main__":
    sys.exit(paired.main(__doc__, measure))
