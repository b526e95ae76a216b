"""The Open Inference Protocol's gRPC form through Ray Serve's gRPC proxy, its messages to and from the REST path's.

KServe v2's ``inference.GRPCInferenceService``, with Triton's shared memory RPCs.

The service and its messages are Triton's own generated modules, ``tritonclient.grpc.service_pb2`` /
``service_pb2_grpc`` (Triton's service is a superset of KServe v2's, with the shared memory RPCs): the server speaks
exactly what ``tritonclient.grpc`` speaks, ships no generated code, and a client and the server in one process share
one set of descriptors (two generated copies of ``inference.*`` would collide in protobuf's descriptor pool).

Ray Serve's gRPC proxy calls the ingress deployment's method of the RPC's name with the request message (and the
``grpc_context``); :class:`GrpcIngress` gives the ingress those methods. ``ModelInfer`` turns the message into the
same JSON-plus-binary body an HTTP client sends and parses it with
:func:`ortcapture.serving.protocol.parse_infer_request` — every check and every message of the REST path, the same
ingress ``infer`` (queue bounds, timeouts, batching) — and answers with ``raw_output_contents``. A refusal is a gRPC
status with the REST message (:data:`STATUS`: 400 ``INVALID_ARGUMENT``, 404 ``NOT_FOUND``, 413
``RESOURCE_EXHAUSTED``, 503 ``UNAVAILABLE``, ...).

Ray 2.60's proxy binds its gRPC port on every interface (``[::]:PORT``, ``ray/serve/_private/grpc_util.py``);
:func:`bind_grpc_proxy` (a worker set-up hook of the local cluster) binds it to the server's ``--host`` instead.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ortcapture.serving import cuda_shm, protocol, shm
from ortcapture.serving.protocol import ModelSpec, ProtocolError
from ortcapture.serving.shm import ShmError
from ortcapture.serving.shm_store import check_input_ref, expected_bytes

#: the servicer function Ray Serve's gRPC proxy registers (an import path, imported in the proxy's process)
SERVICER_FUNCTION = "ortcapture.serving.grpc_service.add_inference_servicer"
#: the service's full name, and its RPCs this server answers (the others are gRPC's own UNIMPLEMENTED)
SERVICE = "inference.GRPCInferenceService"
RPCS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
        "ModelStatistics", "ModelInfer", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
        "CudaSharedMemoryStatus")
#: the environment variable :func:`bind_grpc_proxy` reads: the address the gRPC proxy binds
HOST_ENV = "ORTCAPTURE_GRPC_HOST"
#: HTTP status of a refusal -> gRPC status code name
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
          408: "DEADLINE_EXCEEDED", 413: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE"}
#: datatype -> the typed ``InferTensorContents`` field that carries it
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents"}
_FIELDS = sorted(set(CONTENTS.values()) | {"bytes_contents"})


def pb2():
    """``tritonclient.grpc.service_pb2`` (imported on first use: ``import ortcapture.serving`` needs no gRPC)."""
    from tritonclient.grpc import service_pb2

    return service_pb2


def add_inference_servicer(servicer, server) -> None:
    """Ray Serve's servicer function (:data:`SERVICER_FUNCTION`): :data:`RPCS` of :data:`SERVICE`, each unary,
    **without** a request deserializer. The proxy forwards the request's bytes, and the ingress parses them into
    the message (:func:`message`): one parse, no pickling of generated classes (tritonclient's are registered
    under a module name, ``grpc_service_pb2``, that cannot be imported, so pickle cannot carry them). Ray replaces
    the handlers' behaviour with its routing to the ingress method of the RPC's name."""
    import grpc

    def unused(request, context):  # noqa: ARG001 - Ray routes the call to the ingress instead
        raise NotImplementedError

    handlers = {name: grpc.unary_unary_rpc_method_handler(unused) for name in RPCS}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def message(request, name: str):
    """``request`` (the bytes Ray's proxy forwards, or a message already) as ``service_pb2.<name>``.
    Raises :class:`ProtocolError` (400) for bytes that are not one."""
    cls = getattr(pb2(), name)
    if isinstance(request, cls):
        return request
    try:
        return cls.FromString(bytes(request))
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        raise ProtocolError(f"the request is not a valid {name} message") from None


def parameters(params) -> dict[str, Any]:
    """A protobuf ``map<string, InferParameter>`` as ``{name: bool | int | str | float}``."""
    out = {}
    for k, p in params.items():
        which = p.WhichOneof("parameter_choice")
        out[k] = getattr(p, which) if which else None
    return out


def _set_parameter(target, value) -> None:
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def _filled_fields(contents) -> list[str]:
    return [f for f in _FIELDS if len(getattr(contents, f))]


def _expected_bytes(t, spec: ModelSpec) -> int | None:
    return expected_bytes(t.name, t.datatype, [int(d) for d in t.shape], spec)


async def decode_infer(msg, spec: ModelSpec, store=None):
    """A ``ModelInferRequest`` as ``(InferRequest, ShmPlan | None)``: the request the REST path would decode from
    the same tensors (:func:`ortcapture.serving.protocol.parse_infer_request` does every check), and the outputs
    that go to shared memory regions (``store``: :class:`ortcapture.serving.shm_store.ShmStore`; without it, an
    input or output naming a region is refused).

    Raises:
        ProtocolError: what the REST path refuses (400, 413), and: ``raw_input_contents`` not one per input that
            has no region, raw bytes other than the tensor's shape x datatype size, ``contents`` together with
            ``raw_input_contents``, typed ``contents`` of another datatype's field, an input with no data at all;
            :class:`~ortcapture.serving.shm.ShmError` for a bad region reference.
    """
    from ortcapture.serving.shm_store import ShmPlan

    inputs_p = [parameters(t.parameters) for t in msg.inputs]
    outputs_p = [parameters(o.parameters) for o in msg.outputs]
    names = [p[shm.REGION] for p in inputs_p + outputs_p if isinstance(p.get(shm.REGION), str)]
    if names and store is None:
        raise ShmError("this server has no shared memory")
    regions = await store.regions(names) if names else {}
    raw = list(msg.raw_input_contents)
    total = sum(len(r) for r in raw)
    if total > spec.max_body_bytes:
        raise ProtocolError(f"raw_input_contents of {total} bytes are past the cap of {spec.max_body_bytes} bytes",
                            413)
    entries, pieces, next_raw = [], [], 0
    plan = ShmPlan()
    specs, read = {s.name: s for s in spec.inputs}, {}
    for t, params in zip(msg.inputs, inputs_p):
        where = f"input {t.name[:100]!r}"
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]}
        kept = {k: v for k, v in params.items() if k not in shm.PARAMETERS and k != "binary_data_size"}
        filled = _filled_fields(t.contents) if t.HasField("contents") else []
        expected = _expected_bytes(t, spec)
        if shm.uses_shm(params):
            shm.region_only(where, "contents" if filled else None)
            ref = shm.reference(params, where, regions)
            if ref.region.kind == "cuda":  # stays on the device: the session replica gathers it
                plan.add_input(t.name, cuda_shm.device_tensor(ref, entry, specs, where))
                continue
            check_input_ref(ref, t.name, expected, spec, read)
            data = store.maps.read(ref)
        elif raw:
            if filled:
                raise ProtocolError(f"{where}: contents and raw_input_contents in one request (use one of them)")
            if next_raw >= len(raw):
                raise ProtocolError(f"{len(raw)} raw_input_contents for more inputs: one per input without a "
                                    "shared memory region, in input order")
            data = raw[next_raw]
            next_raw += 1
            if expected is not None and len(data) != expected:
                raise ProtocolError(f"{where}: raw_input_contents[{next_raw - 1}] has {len(data)} bytes; shape "
                                    f"{entry['shape']} of {t.datatype} is {expected} bytes")
        elif filled or t.HasField("contents"):
            field = CONTENTS.get(t.datatype)
            if field is None or filled not in ([], [field]):
                raise ProtocolError(f"{where}: contents hold {', '.join(filled) or 'nothing'}; datatype "
                                    f"{t.datatype[:20]} takes " + (field or "raw_input_contents"))
            values = list(getattr(t.contents, field))
            if expected is not None and len(values) != expected // specs[t.name].dtype.itemsize:
                raise ProtocolError(f"{where}: {field} has {len(values)} values; shape {entry['shape']} takes "
                                    f"{expected // specs[t.name].dtype.itemsize}")
            if field in ("fp32_contents", "fp64_contents"):  # exact as raw bytes (NaN too, which JSON has not)
                data = np.asarray(values, dtype="<f4" if field == "fp32_contents" else "<f8").tobytes()
            else:
                entry["data"], entry["parameters"], data = values, kept, None
        else:
            raise ProtocolError(f"{where}: no data (raw_input_contents, contents or {shm.REGION})")
        if data is not None:
            entry["parameters"] = {**kept, "binary_data_size": len(data)}
            pieces.append(data)
        entries.append(entry)
    if next_raw != len(raw):
        raise ProtocolError(f"{len(raw)} raw_input_contents for {next_raw} input(s) that take them")
    asked = []
    try:
        for o, params in zip(msg.outputs, outputs_p):
            op = {"binary_data": True}
            if "classification" in params:
                op["classification"] = params["classification"]
            if shm.uses_shm(params):
                store.add_output(plan, o.name, shm.reference(params, f"output {o.name[:100]!r}", regions), spec)
            asked.append({"name": o.name, "parameters": op})
        req: dict[str, Any] = {"inputs": entries, "parameters": {"binary_data_output": True}}
        if msg.id:
            req["id"] = msg.id
        if asked:
            req["outputs"] = asked
        head = json.dumps(req).encode()
        request = protocol.parse_infer_request(head, len(head), spec, plan.device_inputs, pieces)
        if plan:
            plan.take_outputs(request)
    except BaseException:
        plan.close()  # the output regions opened before the refusal
        raise
    return request, (plan if plan else None)


def encode_infer(spec: ModelSpec, request, outputs, shm_entries=()):
    """The ``ModelInferResponse`` for ``request`` (:func:`decode_infer`): the requested outputs as
    ``raw_output_contents`` (little-endian, in order), then the outputs written to regions (``shm_entries``:
    :meth:`ShmStore.write_outputs`' entries; metadata and region parameters only, no contents)."""
    p = pb2()
    res = p.ModelInferResponse(model_name=spec.name, model_version=spec.version, id=request.id or "")
    specs = {s.name: s for s in spec.outputs}
    for name, _ in request.outputs:
        a = np.asarray(outputs[name])
        datatype = specs[name].datatype if name in specs else protocol.datatype_of(a.dtype)
        wire = a.dtype if datatype == "BF16" else np.dtype(protocol.DATATYPES[datatype])
        res.outputs.add(name=name, datatype=datatype, shape=[int(d) for d in a.shape])
        res.raw_output_contents.append(np.ascontiguousarray(a, dtype=wire).tobytes())
    for e in shm_entries:
        t = res.outputs.add(name=e["name"], datatype=e["datatype"], shape=e["shape"])
        for k, v in e["parameters"].items():
            _set_parameter(t.parameters[k], v)
    return res


def model_metadata(spec: ModelSpec):
    """``ModelMetadataResponse`` (REST's ``GET /v2/models/{name}``)."""
    p = pb2()
    m = protocol.model_metadata(spec)
    res = p.ModelMetadataResponse(name=m["name"], versions=m["versions"], platform=m["platform"])
    for kind in ("inputs", "outputs"):
        for t in m[kind]:
            getattr(res, kind).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return res


def from_json(body: dict, message):
    """``body`` (a REST answer) parsed into protobuf ``message`` (fields it does not have are left out)."""
    from google.protobuf import json_format

    return json_format.ParseDict(body, message, ignore_unknown_fields=True)


class GrpcIngress:
    """The ``GRPCInferenceService`` methods of the ingress deployment (a mixin). The class it is mixed into has
    ``spec`` (:class:`ModelSpec`), ``options`` (``token``), ``router`` (:class:`ortcapture.serving.routes.Router`),
    ``shm`` (:class:`ortcapture.serving.shm_store.ShmStore` or ``None``) and ``async ready()`` / ``async
    _infer(feeds, device_outputs)`` — the ones the REST routes call."""

    #: requests being answered (the host class counts its HTTP ones in the same attribute: a shutdown waits for both)
    _in_flight: int = 0
    #: set by the host class when it shuts down: every RPC is refused then (``UNAVAILABLE``), as HTTP is (503) — a
    #: shared memory registration after the drain unregistered every region would make the registry again
    _draining: bool = False

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _refuse(self, ctx, status: int, message: str, response):
        import grpc

        if ctx is not None:
            ctx.set_code(getattr(grpc.StatusCode, STATUS.get(status, "UNKNOWN")))
            ctx.set_details(message)
        self.router.http_errors[status] = self.router.http_errors.get(status, 0) + 1
        return response

    def _authorized(self, ctx) -> bool:
        token = getattr(self.options, "token", None)
        if not token:
            return True
        import hmac

        for k, v in (ctx.invocation_metadata() if ctx is not None else []):
            if k.lower() == "authorization":
                scheme, _, given = str(v).strip().partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"),
                                                                      token.encode()):
                    return True
        return False

    def _model_refusal(self, name: str, version: str) -> ProtocolError | None:
        spec = self.spec
        if name != spec.name:
            return ProtocolError(f"unknown model {name[:100]!r}: this server serves {spec.name!r}", 404)
        if version not in ("", spec.version):
            return ProtocolError(f"model {name!r} has no version {version[:40]!r}: it serves version "
                                 f"{spec.version!r}", 404)
        return None

    async def _serve(self, ctx, request, names: tuple[str, str], work, *, auth: bool = True,
                     model: tuple[str, str] | None = None):
        """Parse ``request`` as ``names[0]``, check the token (``auth``) and the model it names (``model``: the
        message's name and version fields), answer ``await work(msg)``; a :class:`ProtocolError` becomes its gRPC
        status and an empty ``names[1]``, anything else ``INTERNAL``. While the host class drains, ``UNAVAILABLE``
        ("the server is shutting down") before anything else. Every RPC let in counts in ``_in_flight`` until it is
        answered, so a drain waits for it: a shared memory registration that passed the check just before the drain
        began would otherwise land after the drain unregistered every region, and make the registry again."""
        response_type = getattr(pb2(), names[1])
        if self._draining:
            return self._refuse(ctx, 503, "the server is shutting down", response_type())
        self._in_flight += 1
        try:
            return await self._answer(ctx, request, names, work, response_type, auth, model)
        finally:
            self._in_flight -= 1

    async def _answer(self, ctx, request, names, work, response_type, auth, model):
        """:meth:`_serve` past the drain check."""
        if auth and not self._authorized(ctx):
            return self._refuse(ctx, 401, "this server needs 'authorization: Bearer <token>' metadata",
                                response_type())
        try:
            msg = message(request, names[0])
            if model is not None:
                refused = self._model_refusal(getattr(msg, model[0]), getattr(msg, model[1]))
                if refused is not None:
                    raise refused
            return await work(msg)
        except ProtocolError as exc:
            return self._refuse(ctx, exc.status, str(exc), response_type())
        except Exception as exc:  # noqa: BLE001 - a server fault: say what, keep serving
            return self._refuse(ctx, 500, f"internal error: {type(exc).__name__}: {exc}", response_type())

    # -- health and metadata -------------------------------------------------------------------------------------
    async def ServerLive(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        """``ServerLive``: live while the server runs (no token needed, as ``/v2/health/live``)."""
        async def _work(msg):
            return pb2().ServerLiveResponse(live=True)
        return await self._serve(grpc_context, request, ("ServerLiveRequest", "ServerLiveResponse"), _work,
                                 auth=False)

    async def ServerReady(self, request, grpc_context=None):  # noqa: N802
        """``ServerReady``: ready once a model replica is warm (no token needed)."""
        async def _work(msg):
            return pb2().ServerReadyResponse(ready=bool(await self.ready()))
        return await self._serve(grpc_context, request, ("ServerReadyRequest", "ServerReadyResponse"), _work,
                                 auth=False)

    async def ModelReady(self, request, grpc_context=None):  # noqa: N802
        """``ModelReady``: as ``ServerReady`` for the served model (``NOT_FOUND`` for another)."""
        async def _work(msg):
            return pb2().ModelReadyResponse(ready=bool(await self.ready()))
        return await self._serve(grpc_context, request, ("ModelReadyRequest", "ModelReadyResponse"), _work,
                                 model=("name", "version"))

    async def ServerMetadata(self, request, grpc_context=None):  # noqa: N802
        """``ServerMetadata``: name, version, extensions."""
        async def _work(msg):
            return from_json(self.router.server_metadata(), pb2().ServerMetadataResponse())
        return await self._serve(grpc_context, request, ("ServerMetadataRequest", "ServerMetadataResponse"), _work)

    async def ModelMetadata(self, request, grpc_context=None):  # noqa: N802
        """``ModelMetadata``: inputs and outputs with datatypes and shapes (-1 for dynamic dims)."""
        async def _work(msg):
            return model_metadata(self.spec)
        return await self._serve(grpc_context, request, ("ModelMetadataRequest", "ModelMetadataResponse"), _work,
                                 model=("name", "version"))

    async def ModelConfig(self, request, grpc_context=None):  # noqa: N802
        """``ModelConfig``: Triton's model configuration (REST's ``/config``)."""
        async def _work(msg):
            from tritonclient.grpc import model_config_pb2

            cfg = from_json(protocol.model_config(self.spec), model_config_pb2.ModelConfig())
            return pb2().ModelConfigResponse(config=cfg)
        return await self._serve(grpc_context, request, ("ModelConfigRequest", "ModelConfigResponse"), _work,
                                 model=("name", "version"))

    async def ModelStatistics(self, request, grpc_context=None):  # noqa: N802
        """``ModelStatistics``: Triton's statistics (REST's ``/stats`` without the ``ortcapture`` section)."""
        async def _work(msg):
            if msg.name:
                refused = self._model_refusal(msg.name, msg.version)
                if refused is not None:
                    raise refused
            refresh = getattr(self, "_refresh_reports", None)  # the tier's: fetch the session replicas' reports
            if refresh is not None:
                await refresh()
            stats = protocol.statistics(self.spec, self.router.replicas())
            return from_json(stats, pb2().ModelStatisticsResponse())
        return await self._serve(grpc_context, request, ("ModelStatisticsRequest", "ModelStatisticsResponse"), _work)

    # -- inference -----------------------------------------------------------------------------------------------
    async def ModelInfer(self, request, grpc_context=None):  # noqa: N802
        """``ModelInfer``: the REST path's checks and batching (the ingress's ``infer``); outputs as
        ``raw_output_contents``, or written to the shared memory regions they name."""
        async def _work(msg):
            if not await self.ready():
                raise ProtocolError(f"model {self.spec.name!r} is not ready: its replicas are not warm yet", 503)
            req, plan = await decode_infer(msg, self.spec, self.shm)
            try:
                result = await self._infer(req.inputs, **(plan.infer_kwargs() if plan is not None else {}))
                if "error" in result:
                    raise ProtocolError(str(result["error"]), int(result.get("status", 500)))
                entries = () if plan is None else (self.shm.write_outputs(plan, result["outputs"], self.spec)
                                                   + plan.device_entries(result["outputs"]))
                return encode_infer(self.spec, req, result["outputs"], entries)
            finally:
                if plan is not None:  # the output regions' descriptors it holds
                    plan.close()
        return await self._serve(grpc_context, request, ("ModelInferRequest", "ModelInferResponse"), _work,
                                 model=("model_name", "model_version"))

    # -- system shared memory ------------------------------------------------------------------------------------
    def _shm_or_refuse(self):
        if self.shm is None:
            raise ShmError("this server has no shared memory")
        return self.shm

    async def _unregister(self, grpc_context, request, rpc: str, kind: str):
        """``<rpc>Unregister`` for regions of ``kind`` (``"system"``, ``"cuda"``)."""
        async def _work(msg):
            await self._shm_or_refuse().unregister(msg.name or None, kind)
            return getattr(pb2(), f"{rpc}UnregisterResponse")()
        return await self._serve(grpc_context, request, (f"{rpc}UnregisterRequest", f"{rpc}UnregisterResponse"),
                                 _work)

    async def _status(self, grpc_context, request, rpc: str, kind: str):
        """``<rpc>Status`` of regions of ``kind``: each region's Triton status entry."""
        async def _work(msg):
            cls = getattr(pb2(), f"{rpc}StatusResponse")
            res = cls()
            for r in await self._shm_or_refuse().status(msg.name or None, kind):
                res.regions[r["name"]].CopyFrom(cls.RegionStatus(**r))
            return res
        return await self._serve(grpc_context, request, (f"{rpc}StatusRequest", f"{rpc}StatusResponse"), _work)

    async def SystemSharedMemoryRegister(self, request, grpc_context=None):  # noqa: N802
        """``SystemSharedMemoryRegister``: a region of a client's ``/dev/shm`` object (loopback clients only)."""
        async def _work(msg):
            peer = grpc_context.peer() if grpc_context is not None else None
            await self._shm_or_refuse().register(msg.name, msg.key, int(msg.offset), int(msg.byte_size), peer)
            return pb2().SystemSharedMemoryRegisterResponse()
        return await self._serve(grpc_context, request, ("SystemSharedMemoryRegisterRequest",
                                                         "SystemSharedMemoryRegisterResponse"), _work)

    async def SystemSharedMemoryUnregister(self, request, grpc_context=None):  # noqa: N802
        """``SystemSharedMemoryUnregister``: the region named, or every one (an empty name)."""
        return await self._unregister(grpc_context, request, "SystemSharedMemory", "system")

    async def SystemSharedMemoryStatus(self, request, grpc_context=None):  # noqa: N802
        """``SystemSharedMemoryStatus``: the region named, or every one (an empty name)."""
        return await self._status(grpc_context, request, "SystemSharedMemory", "system")

    # -- CUDA shared memory (ortcapture.serving.cuda_shm) ---------------------------------------------------------
    async def CudaSharedMemoryRegister(self, request, grpc_context=None):  # noqa: N802
        """``CudaSharedMemoryRegister``: a client's CUDA allocation by its IPC handle (loopback clients only; a
        server on CUDA: elsewhere ``INVALID_ARGUMENT``)."""
        async def _work(msg):
            peer = grpc_context.peer() if grpc_context is not None else None
            await self._shm_or_refuse().register_cuda(msg.name, bytes(msg.raw_handle), int(msg.device_id),
                                                      int(msg.byte_size), peer)
            return pb2().CudaSharedMemoryRegisterResponse()
        return await self._serve(grpc_context, request, ("CudaSharedMemoryRegisterRequest",
                                                         "CudaSharedMemoryRegisterResponse"), _work)

    async def CudaSharedMemoryUnregister(self, request, grpc_context=None):  # noqa: N802
        """``CudaSharedMemoryUnregister``: the CUDA region named, or every one (an empty name)."""
        return await self._unregister(grpc_context, request, "CudaSharedMemory", "cuda")

    async def CudaSharedMemoryStatus(self, request, grpc_context=None):  # noqa: N802
        """``CudaSharedMemoryStatus``: the CUDA region named, or every one (an empty name)."""
        return await self._status(grpc_context, request, "CudaSharedMemory", "cuda")


def grpc_options(options):
    """Ray Serve's ``gRPCOptions`` for checked ``options`` (``grpc_port`` set): Triton's servicer on that port."""
    from ray.serve.config import gRPCOptions

    return gRPCOptions(port=options.grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION])


def proxy_runtime_env(options) -> dict:
    """What ``ray.init(runtime_env=...)`` of a new local cluster needs so that Ray's gRPC proxy binds ``--host``
    rather than every interface: :func:`bind_grpc_proxy` as the workers' set-up hook, the host in
    :data:`HOST_ENV`. Empty when gRPC is off or ``--host`` is every interface anyway."""
    if not getattr(options, "grpc_port", None) or options.host in ("0.0.0.0", "::", ""):
        return {}
    return {"worker_process_setup_hook": "ortcapture.serving.grpc_service.bind_grpc_proxy",
            "env_vars": {HOST_ENV: options.host}}


def bind_grpc_proxy() -> None:
    """Worker set-up hook: make Ray Serve's gRPC proxy in this process bind :data:`HOST_ENV`'s address instead of
    ``[::]`` (Ray 2.60 binds ``[::]:PORT`` whatever ``--host``; ``ray/serve/_private/default_impl.py``'s
    ``add_grpc_address``, looked up when the proxy starts its server). Other Ray layouts are left alone."""
    host = os.environ.get(HOST_ENV)
    if not host:
        return
    try:
        from ray.serve._private import default_impl
    except ImportError:
        return
    real = getattr(default_impl, "add_grpc_address", None)
    if real is None or getattr(real, "ortcapture_host", None):
        return

    def add_grpc_address(server, address: str):
        if address.startswith("[::]:") or address.startswith("0.0.0.0:"):
            h = f"[{host}]" if ":" in host else host
            address = f"{h}:{address.rsplit(':', 1)[1]}"
        return real(server, address)

    add_grpc_address.ortcapture_host = host
    default_impl.add_grpc_address = add_grpc_address
