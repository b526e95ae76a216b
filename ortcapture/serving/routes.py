"""The Open Inference Protocol's HTTP endpoints over any backend: routing, status codes, the body cap (no Ray).

:class:`Router` answers one HTTP request given its method, path, headers and a way to read the body; the backend
(the Ray ingress deployment, or a test double) says whether the model is ready and runs one request. Endpoints:

=================================================  ==========================================================
``GET  /v2/health/live``                           200 while the server runs
``GET  /v2/health/ready``                          200 once the model's replicas are warm, 503 before
``GET  /v2``                                       server metadata
``GET  /v2/models/{name}[/versions/{v}]``          model metadata (shapes with -1 for dynamic dims)
``GET  /v2/models/{name}[/versions/{v}]/ready``    200 / 503
``GET  /v2/models/{name}[/versions/{v}]/config``   Triton's model configuration (name, platform, max_batch_size, dims)
``POST /v2/models/{name}[/versions/{v}]/infer``    inference (JSON tensors, binary tensor data extension)
``GET  /v2/models[/{name}[/versions/{v}]]/stats``  Triton's statistics extension + ``ortcapture`` per replica
=================================================  ==========================================================

Errors are ``{"error": "..."}`` with 400 (bad request), 401 (a bearer token is required and was not given or is
wrong: every endpoint but ``/v2/health/*``), 404 (unknown model, version or endpoint), 405 (method), 408 (the body
made no progress for the body timeout), 413 (body past the cap), 503 (not ready, too many requests queued or
sending their bodies, or no replica answered in time: with ``Retry-After``). Nothing a client sends gets a 5xx:
every client mistake is caught by :mod:`ortcapture.serving.protocol` or the replica's own check
(:meth:`ortcapture.serving.BatchRunner.rows`) first; an unexpected failure inside the server is a 500 naming it.
"""
from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping
from urllib.parse import unquote

from ortcapture.serving import protocol
from ortcapture.serving.protocol import ModelSpec, ProtocolError

#: a replica report older than this (seconds) is dropped from ``/stats`` (replicas push one every second or so)
STALE_S = 10.0


@dataclass
class Response:
    """An HTTP response: ``status``, ``body`` bytes and ``headers``."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})


def json_response(status: int, obj: Any) -> Response:
    """``obj`` (anything :func:`json.dumps` takes, finite numbers only: RFC 8259 has no NaN or infinity) as a JSON
    body with ``status``. Raises ``ValueError`` for a non-finite float (a server fault: a 500)."""
    return Response(status, json.dumps(obj, allow_nan=False).encode())


#: seconds a client is asked to wait (``Retry-After``) after a 503: no replica warm yet, a full queue, too many
#: pending bodies, no replica answered in time
RETRY_AFTER_S = 1


def error(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """``{"error": message}`` with ``status`` (and extra ``headers``, e.g. ``Retry-After``)."""
    return Response(status, protocol.error_body(message), {"Content-Type": "application/json", **(headers or {})})


class Refusal(ProtocolError):
    """A refusal that carries response ``headers`` (``Retry-After``, ``Connection: close``) besides its status."""

    def __init__(self, message: str, status: int, headers: Mapping[str, str]):
        super().__init__(message, status)
        self.headers = dict(headers)


class Router:
    """The endpoints of one served model.

    Args:
        spec: the model (:class:`ortcapture.serving.protocol.ModelSpec`), with the body cap.
        ready: ``async () -> bool``: whether a warm replica can take requests.
        infer: ``async (feeds) -> {"outputs": {name: numpy array}}`` or ``{"error": str, "status": int}`` (a 4xx for
            what the replica refuses, 503 where no replica could run it).
        server_name: ``GET /v2``'s ``name``.
        server_version: ``GET /v2``'s ``version``.
        token: a bearer token: every endpoint but ``/v2/health/live`` and ``/v2/health/ready`` then needs
            ``Authorization: Bearer <token>`` (compared in constant time); ``None``: no authentication.
        ingress_stats: ``() -> dict`` shown under ``/stats``' ``ortcapture.ingress`` (queue, bodies in flight).
        shm: system shared memory (``ortcapture.serving.shm_store.ShmStore``): ``/v2/systemsharedmemory/...``
            and infer requests that name regions; ``None``: neither.
        align_inputs: ``False``: binary inputs reach ``infer`` as views of the body even where the JSON header's
            length leaves them unaligned (:func:`~ortcapture.serving.protocol.parse_infer_request`'s ``align``) —
            for a backend that copies every request's rows anyway (the batching tier: into its batch, or through
            Ray, which hands them over aligned). Saves a copy of each request's tensors (~8 % of a busy tier
            replica's CPU at 32 HTTP clients, 1.2 MB images, py-spy on an H100).
    """

    def __init__(self, spec: ModelSpec, ready: Callable[[], Awaitable[bool]],
                 infer: Callable[[dict], Awaitable[Mapping]], *, server_name: str = "ortcapture",
                 server_version: str = "", token: str | None = None,
                 ingress_stats: Callable[[], Mapping] | None = None, shm=None, align_inputs: bool = True):
        self.spec = spec
        self._align = align_inputs
        self._token = None if token is None else token.encode()
        self._ingress_stats = ingress_stats
        self._ready = ready
        self._infer = infer
        self._server = {"name": server_name, "version": server_version,
                        "extensions": ["binary_tensor_data", "statistics"]}
        self._shm = shm  # hook: system shared memory (ortcapture.serving.shm_store)
        if shm is not None:
            self._server["extensions"].append("system_shared_memory")
            if shm.cuda_open is not None:  # a server on CUDA (ortcapture.serving.cuda_shm)
                self._server["extensions"].append("cuda_shared_memory")
        self._reports: dict[str, tuple[float, dict]] = {}
        self.http_errors: dict[int, int] = {}

    # -- replica reports ----------------------------------------------------------------------------------------
    def report(self, replica: str, data: Mapping, now: float | None = None) -> None:
        """Keep replica ``replica``'s latest report (shown under ``/stats``' ``ortcapture`` section)."""
        self._reports[str(replica)] = (time.monotonic() if now is None else now, dict(data))

    def replicas(self, now: float | None = None) -> list[dict]:
        """The reports of the replicas heard from in the last :data:`STALE_S` seconds, by replica id."""
        now = time.monotonic() if now is None else now
        for k in [k for k, (t, _) in self._reports.items() if now - t > STALE_S]:
            del self._reports[k]
        return [{"replica": k, **d} for k, (_, d) in sorted(self._reports.items())]

    def server_metadata(self) -> dict:
        """``GET /v2``'s body: name, version, extensions."""
        return {**self._server, "extensions": list(self._server["extensions"])}

    # -- requests -----------------------------------------------------------------------------------------------
    async def handle(self, method: str, path: str, headers: Mapping[str, str],
                     read_body: Callable[[int], Awaitable[bytes]], client: str | None = None) -> Response:
        """Answer one request. ``headers``: lower-case names. ``read_body(cap)``: the raw body, raising
        :class:`~ortcapture.serving.protocol.ProtocolError` (413) past ``cap`` bytes. ``client``: the peer's
        address (shared memory registration is for loopback clients). Never raises."""
        try:
            response = self._authorize(path, headers) or await self._route(method.upper(), path, headers, read_body,
                                                                           client)
        except ProtocolError as exc:
            response = error(exc.status, str(exc), getattr(exc, "headers", None))
        except Exception as exc:  # noqa: BLE001 - a server fault: say what, keep serving
            response = error(500, f"internal error: {type(exc).__name__}: {exc}")
        if response.status >= 400:
            self.http_errors[response.status] = self.http_errors.get(response.status, 0) + 1
        return response

    def _authorize(self, path: str, headers: Mapping[str, str]) -> Response | None:
        """``None`` when the request may go on: no token configured, a health endpoint, or the right bearer token;
        else a 401."""
        if self._token is None:
            return None
        if path.split("?", 1)[0].rstrip("/") in ("/v2/health/live", "/v2/health/ready"):
            return None
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "replace"), self._token):
            return None
        return error(401, "this server needs 'Authorization: Bearer <token>'", {"WWW-Authenticate": "Bearer"})

    async def _route(self, method: str, path: str, headers, read_body, client: str | None = None) -> Response:
        parts = [unquote(p) for p in path.split("?", 1)[0].strip("/").split("/")]
        if not parts or parts[0] != "v2":
            return error(404, f"unknown endpoint {path[:200]!r}: the Open Inference Protocol lives under /v2")
        rest = parts[1:]
        if rest in ([], [""]):
            return self._get(method) or json_response(200, self._server)
        if rest[0] == "health" and len(rest) == 2 and rest[1] in ("live", "ready"):
            if method != "GET":
                return error(405, f"{path} takes GET")
            if rest[1] == "live":
                return json_response(200, {"live": True})
            return await self._readiness()
        if rest[0] in ("systemsharedmemory", "cudasharedmemory") and self._shm is not None:  # hook: shm_store
            return await self._shm.route(method, rest[1:], client, read_body, rest[0][:-len("sharedmemory")])
        if rest[0] != "models":
            return error(404, f"unknown endpoint {path[:200]!r}")
        if rest == ["models", "stats"]:
            return self._get(method) or self._stats()
        if len(rest) < 2:
            return error(404, f"unknown endpoint {path[:200]!r}")
        name, tail = rest[1], rest[2:]
        if name != self.spec.name:
            return error(404, f"unknown model {name[:100]!r}: this server serves {self.spec.name!r}")
        if tail[:1] == ["versions"]:
            if len(tail) < 2 or tail[1] != self.spec.version:
                return error(404, f"model {name!r} has no version {(tail[1] if len(tail) > 1 else '')[:40]!r}: "
                             f"it serves version {self.spec.version!r}")
            tail = tail[2:]
        if tail == []:
            return self._get(method) or json_response(200, protocol.model_metadata(self.spec))
        if tail == ["ready"]:
            return self._get(method) or await self._readiness()
        if tail == ["config"]:
            return self._get(method) or json_response(200, protocol.model_config(self.spec))
        if tail == ["stats"]:
            return self._get(method) or self._stats()
        if tail == ["infer"]:
            if method != "POST":
                return error(405, f"{path} takes POST")
            return await self._infer_request(headers, read_body)
        return error(404, f"unknown endpoint {path[:200]!r}")

    @staticmethod
    def _get(method: str) -> Response | None:
        return None if method == "GET" else error(405, "this endpoint takes GET")

    async def _readiness(self) -> Response:
        if await self._ready():
            return json_response(200, {"ready": True})
        return error(503, f"model {self.spec.name!r} is not ready: its replicas are not warm yet")

    def _stats(self) -> Response:
        body = protocol.statistics(self.spec, self.replicas())
        ingress = {"http_errors": {str(k): v for k, v in sorted(self.http_errors.items())}}
        if self._ingress_stats is not None:
            ingress.update(self._ingress_stats())
        body["model_stats"][0]["ortcapture"]["ingress"] = ingress
        return json_response(200, body)

    async def _infer_request(self, headers: Mapping[str, str], read_body) -> Response:
        cap = self.spec.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return error(400, f"Content-Length {length[:40]!r} is not an integer")
            if declared > cap:
                return error(413, f"request body of {declared} bytes is past the cap of {cap} bytes")
        if not await self._ready():  # a retry soon may find it warm (Retry-After, like the other 503s)
            return error(503, f"model {self.spec.name!r} is not ready: its replicas are not warm yet",
                         {"Retry-After": str(RETRY_AFTER_S)})
        body = await read_body(cap)
        body = protocol.decode_body(body, headers.get("content-encoding"), cap)
        header_length, plan = headers.get(protocol.HEADER_LENGTH.lower()), None
        if self._shm is not None:  # hook: inputs read from shared memory regions (ortcapture.serving.shm_store)
            body, header_length, plan = await self._shm.prepare_http(body, header_length, self.spec)
        try:
            request = protocol.parse_infer_request(body, header_length, self.spec,
                                                   plan.device_inputs if plan is not None else (),
                                                   plan.pieces if plan is not None else None, align=self._align)
            if plan is not None:
                plan.take_outputs(request)
            result = await self._infer(request.inputs, **(plan.infer_kwargs() if plan is not None else {}))
            if "error" in result:
                retry = result.get("retry_after")
                return error(int(result.get("status", 500)), str(result["error"]),
                             {"Retry-After": str(int(retry))} if retry is not None else None)
            payload, out_headers = protocol.encode_infer_response(self.spec, request, result["outputs"])
            if plan is not None:  # hook: outputs written to shared memory regions
                payload, out_headers = self._shm.finish_http(plan, result["outputs"], self.spec, payload,
                                                             out_headers)
            return Response(200, payload, out_headers)
        finally:
            if plan is not None:  # the output regions' descriptors it holds
                plan.close()
