"""System shared memory in the ingress: the registry's home, the HTTP endpoints, infer requests naming regions.

The pure rules are :mod:`ortcapture.serving.shm`.

**Where a region lives.** The ingress maps it (the process that parses requests; a model replica may be another
process on another node and never touches client memory). The registry — names to (key, offset, byte_size) — is one
per server, so that a region registered through one ingress replica is known to every other: a named Ray actor of the
application (:class:`RegistryActor`, created by the first ingress replica that needs it, ``get_if_exists``). Each
ingress replica looks up the regions a request names and maps them lazily, once per registration
(:class:`ortcapture.serving.shm.Maps`; a name registered again, or unregistered through another replica, is seen on
the next request). A lookup calls the actor only when the registry's count of changes — a file on the actor's node,
:mod:`ortcapture.serving.shm_version` — moved since this replica last asked, or a name is not among the registered
regions it remembers; a replica on
another node, or one that finds the actor's process gone, calls it (the call that finds it gone makes a new one).
Registration checks the object's size where it is mapped. The actor dies with the ingress that made it (a server
that stops forgets its regions); a replica that finds it gone makes a new, empty one (clients register again: their
requests name unknown regions, a 400; its generations never repeat the old registry's).

Registration is refused unless the client is on loopback (:func:`ortcapture.serving.shm.is_loopback`; a remote client
could otherwise name any ``/dev/shm`` key of the server's machine) — ``allow_remote`` lifts it.

:class:`LocalRegistry` is the same registry in process (one ingress, and the unit tests).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ortcapture.serving import cuda_shm, protocol, shm
from ortcapture.serving.shm import Maps, Ref, Region, Regions, ShmError
from ortcapture.serving.shm_version import VersionFile, VersionReader


class LocalRegistry:
    """The registry in this process (``async`` like the actor's: :class:`ShmStore` awaits either)."""

    def __init__(self):
        self.regions = Regions()

    async def register(self, name, key, offset, byte_size) -> Region:
        """:meth:`Regions.register`."""
        return self.regions.register(name, key, offset, byte_size)

    async def register_cuda(self, name, raw_handle, device_id, byte_size) -> Region:
        """:meth:`Regions.register_cuda`."""
        return self.regions.register_cuda(name, raw_handle, device_id, byte_size)

    async def unregister(self, name: str | None, kind: str = "system") -> list[str]:
        """:meth:`Regions.unregister`."""
        return self.regions.unregister(name, kind)

    async def status(self, name: str | None, kind: str = "system") -> list[dict]:
        """:meth:`Regions.status`."""
        return self.regions.status(name, kind)

    async def lookup(self, names) -> dict[str, Region]:
        """:meth:`Regions.lookup`."""
        return self.regions.lookup(names)


class RegistryActor:
    """The registry as a Ray actor (one per application, named ``<app>-shm``): :class:`Regions` behind actor calls;
    a refusal comes back as ``{"error": message}`` (a :class:`ShmError` does not cross Ray as itself). Its count of
    changes is in a node-local file (:class:`ortcapture.serving.shm_version.VersionFile`) that ingress replicas on its
    node read instead of calling :meth:`call` ``("lookup", ...)`` for every request."""

    def __init__(self):
        self.regions = Regions()
        try:
            self.version: VersionFile | None = VersionFile()
        except OSError:  # no /dev/shm room: every lookup is a call
            self.version = None
        self.node = node_id()

    def call(self, method: str, *args):
        """``Regions.<method>(*args)`` as ``{"ok": result}`` — a lookup's reply also says where the count of changes
        is (``"where"``: ``(path, pid, node id)``) and its value (``"count"``) — or
        ``{"error": message}`` for what it refuses. A registration or unregistration is counted before this
        returns."""
        try:
            out = {"ok": getattr(self.regions, method)(*args)}
        except ShmError as exc:
            return {"error": str(exc)}
        if self.version is not None:
            if method in CHANGES:
                self.version.bump()
            if method == "lookup":
                out["count"], out["where"] = self.version.version, (self.version.path, os.getpid(), self.node)
        return out

    def close(self) -> None:
        """Unlink the count's file (the server stops; the actor is killed next)."""
        if getattr(self, "version", None) is not None:
            self.version.close()

    def __del__(self):
        self.close()


def node_id() -> str | None:
    """This process's Ray node (``None`` outside a Ray worker)."""
    import ray

    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not in a worker
        return None


#: the :class:`Regions` methods that change the registry (counted by :class:`RegistryActor`)
CHANGES = frozenset({"register", "register_cuda", "unregister"})
#: the most registered regions an ingress replica remembers for one count of changes (only registered ones: a name
#: that is not is asked of the actor every time, so names from clients' requests never grow it)
MAX_KNOWN = 4096


class ActorRegistry:
    """The client side of :class:`RegistryActor` in an ingress (or session) replica: the actor ``name`` in Ray
    namespace ``namespace``, made on first use if no replica made it yet (and again if it died).

    :meth:`lookup` on the actor's node calls the actor only when its count of changes moved since the last call
    (read from its :class:`~ortcapture.serving.shm_version.VersionFile` through a
    :class:`~ortcapture.serving.shm_version.VersionReader`) or a name is not a registered region it remembers
    (only those are kept, at most :data:`MAX_KNOWN`); elsewhere, or once
    the actor's process is gone, every lookup is a call (the call finds the actor dead and makes a new, empty one).
    ``read_count=False``: every lookup is a call (as before the count; ``benchmarks/ingress_costs.py`` times both).
    ``create=False`` (a session replica, which only asks which of its CUDA regions are still registered): the actor is
    never made here — none running answers "nothing is registered" (a server that stops ends it; a replica's
    per-second lookup must not make it again)."""

    def __init__(self, name: str, namespace: str = "ortcapture", read_count: bool = True, create: bool = True):
        self.name, self.namespace, self.read_count, self.create = name, namespace, read_count, create
        self._actor = None
        self._made = 0  # handles made: a reply from an earlier one is not remembered
        self._reader: VersionReader | None = None  # the actor's count of changes, when it is on this node
        self._known: dict[str, Region] = {}  # registered regions looked up at count _known_version
        self._known_version: tuple[str, int] | None = None
        self.lookups = 0  # lookups asked of this object
        self.calls = 0  # lookups that called the actor (the others were answered here)

    def _handle(self, fresh: bool = False):
        import ray

        if self._actor is None or fresh:
            self._forget()
            self._made += 1
            if self.create:
                cls = ray.remote(num_cpus=0, max_restarts=0)(RegistryActor)
                self._actor = cls.options(name=self.name, namespace=self.namespace, get_if_exists=True).remote()
            else:
                try:
                    self._actor = ray.get_actor(self.name, namespace=self.namespace)
                except ValueError:  # none runs
                    self._actor = None
        return self._actor

    def _forget(self) -> None:
        """Drop what was looked up and the view of the count (another actor, or this one's process is gone)."""
        if self._reader is not None:
            self._reader.close()
        self._reader, self._known, self._known_version = None, {}, None

    async def _reply(self, method: str, *args) -> dict:
        """The actor's reply, with ``"handle"``: which of this object's handles answered (:meth:`_remember` keeps
        only the current one's). Without ``create``, no running actor replies ``{"ok": {}}`` to a lookup."""
        import ray

        try:
            handle = self._handle()
            made = self._made
            if handle is None:
                raise ray.exceptions.RayActorError()
            out = await handle.call.remote(method, *args)
        except ray.exceptions.RayActorError:  # its owner went away: a new, empty registry
            handle = self._handle(fresh=True)
            made = self._made
            if handle is None:
                if method != "lookup":
                    raise ShmError("the shared memory registry is gone (the server is stopping)") from None
                return {"ok": {}, "handle": made}
            out = await handle.call.remote(method, *args)
        if "error" in out:
            raise ShmError(out["error"])
        out["handle"] = made
        return out

    async def _call(self, method: str, *args):
        return (await self._reply(method, *args))["ok"]

    async def register(self, name, key, offset, byte_size) -> Region:
        """:meth:`Regions.register` in the actor."""
        return await self._call("register", name, key, offset, byte_size)

    async def register_cuda(self, name, raw_handle, device_id, byte_size) -> Region:
        """:meth:`Regions.register_cuda` in the actor."""
        return await self._call("register_cuda", name, raw_handle, device_id, byte_size)

    async def unregister(self, name: str | None, kind: str = "system") -> list[str]:
        """:meth:`Regions.unregister` in the actor."""
        return await self._call("unregister", name, kind)

    async def status(self, name: str | None, kind: str = "system") -> list[dict]:
        """:meth:`Regions.status` in the actor."""
        return await self._call("status", name, kind)

    async def lookup(self, names) -> dict[str, Region]:
        """:meth:`Regions.lookup`: answered here when the actor's count of changes has not moved since these names
        were looked up (on its node), else by the actor."""
        names = list(names)
        self.lookups += 1
        known = self._known_here(names)
        if known is not None:
            return known
        self.calls += 1
        out = await self._reply("lookup", names)
        self._remember(out, names)
        return out["ok"]

    def _known_here(self, names: list) -> dict[str, Region] | None:
        reader = self._reader
        if reader is None or self._known_version is None:
            return None
        count = reader.read()
        if count is None:  # the actor's process is gone: the next call makes a new registry
            self._forget()
            return None
        if (reader.path, count) != self._known_version or any(n not in self._known for n in names):
            return None
        return {n: self._known[n] for n in names}

    def _remember(self, out: dict, names: list) -> None:
        """Keep a lookup's reply, labelled with the count it was made at (a reply without one is not kept)."""
        where = out.get("where")
        if where is None or not self.read_count or out.get("handle") != self._made:
            return  # no count, or a reply from an actor this replica has replaced since it asked
        if self._reader is None or self._reader.path != where[0]:
            self._open_reader(where)
        if self._reader is None:  # another node, or no /proc
            return
        version = (where[0], out["count"])
        if version != self._known_version or len(self._known) + len(out["ok"]) > MAX_KNOWN:
            self._known, self._known_version = {}, version
        if len(out["ok"]) <= MAX_KNOWN:
            self._known.update(out["ok"])  # registered regions only (bounded by what clients registered)

    def _open_reader(self, where) -> None:
        path, pid, node = where
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if node is None or node != node_id():  # another node: its /dev/shm is not this one's
            return
        try:
            self._reader = VersionReader(path, pid)
        except (OSError, ValueError):  # no /proc (not Linux), or the file is gone already: calls, as before
            self._reader = None

    async def shutdown(self) -> None:
        """Server shutdown: every region unregistered, the actor's count file unlinked (by the actor: on its node)
        and the actor ended — the one that runs, if any: a replica that never used the registry makes none now,
        and a second shutdown finds none (best effort)."""
        import asyncio

        import ray

        def running():
            """The registry actor that runs, or ``None``."""
            try:
                return ray.get_actor(self.name, namespace=self.namespace)
            except Exception:  # noqa: BLE001 - none was made, or it ended already (ValueError)
                return None
        actor = await asyncio.get_running_loop().run_in_executor(None, running)  # a GCS call: off the event loop
        if actor is not None:
            try:
                for kind in ("system", "cuda"):
                    await actor.call.remote("unregister", None, kind)
                await actor.close.remote()
            except Exception:  # noqa: BLE001 - it died meanwhile
                pass
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self._actor = None
        self._forget()


class ShmStore:
    """System shared memory for one ingress replica: the ``registry`` (:class:`LocalRegistry` or
    :class:`ActorRegistry`) and this process's mappings. ``allow_remote``: registration from a client that is not
    on loopback is allowed too. ``peers_known``: whether a client's address is its own — not so behind Ray Serve's
    HAProxy ingress on a server that listens beyond loopback (every request then comes from HAProxy's address, which
    is 127.0.0.1 on a loopback cluster), so registration is refused there unless ``allow_remote``."""

    def __init__(self, registry, *, allow_remote: bool = False, cuda_open=None, provider: str = "cuda",
                 peers_known: bool = True):
        self.registry = registry
        self.allow_remote = allow_remote
        self.peers_known = peers_known
        self.maps = Maps()
        #: CUDA shared memory: ``async (Region) -> None`` that has a session replica open the region (raising
        #: :class:`ShmError` when it cannot), or ``None``: refused (the server does not run on CUDA: ``provider``)
        self.cuda_open = cuda_open
        self.provider = provider

    # -- the extension's operations (HTTP and gRPC share them) --------------------------------------------------
    def _check_peer(self, peer: str | None) -> None:
        """Registration is for clients on this machine: :class:`ShmError` unless ``allow_remote``, for a ``peer``
        not on loopback, or for any peer when :attr:`peers_known` is false."""
        if self.allow_remote:
            return
        if not self.peers_known:
            raise ShmError("shared memory registration is only for clients on this machine, and behind Ray Serve's "
                           "HAProxy ingress on a server that listens beyond loopback a request carries HAProxy's "
                           "address, not the client's (the server's --allow-remote-shared-memory lifts this)")
        if not shm.is_loopback(peer):
            raise ShmError(f"shared memory registration is only for clients on this machine (loopback); "
                           f"{str(peer)[:60]} is not (the server's --allow-remote-shared-memory lifts this)")

    async def register(self, name, key, offset, byte_size, peer: str | None) -> Region:
        """Register region ``name`` for a client at ``peer``; :class:`ShmError` for a refusal (a remote client,
        a bad key/offset/size, an object smaller than offset + byte_size, a name registered already)."""
        self._check_peer(peer)
        probe = Regions().register(name, key, offset, byte_size)  # the same checks, before the object is opened
        shm.check_object(probe)
        region = await self.registry.register(name, key, offset, byte_size)
        self.maps.drop(name)
        return region

    async def register_cuda(self, name, raw_handle, device_id, byte_size, peer: str | None) -> Region:
        """Register CUDA region ``name`` (:mod:`ortcapture.serving.cuda_shm`) for a client at ``peer``: the handle
        is checked here and opened by a session replica before the name is taken. :class:`ShmError` for a refusal
        (a server not on CUDA, a remote client, a bad handle, device id or size, a handle that does not open, a
        size past the allocation, a name registered already)."""
        if self.cuda_open is None:
            raise ShmError(f"CUDA shared memory needs the CUDA provider; this server runs {self.provider} (use "
                           "system shared memory: /v2/systemsharedmemory)")
        self._check_peer(peer)
        handle = cuda_shm.check_register(name, raw_handle, device_id, byte_size)
        region = await self.registry.register_cuda(name, handle, device_id, byte_size)
        try:  # the registration itself (its generation) is opened: a replica keeps that handle open
            await self.cuda_open(region)
        except BaseException:
            await self.registry.unregister(name, "cuda")
            raise
        return region

    async def unregister(self, name: str | None, kind: str = "system") -> None:
        """Unregister ``name`` (or every region of ``kind`` with ``None``/``""``) and unmap it here (a session
        replica closes a CUDA region's handle within about a second)."""
        for n in await self.registry.unregister(name or None, kind):
            self.maps.drop(n)

    async def status(self, name: str | None, kind: str = "system") -> list[dict]:
        """Triton's status of ``name`` or of every region of ``kind``."""
        return await self.registry.status(name or None, kind)

    async def regions(self, names) -> dict[str, Region]:
        """The registered regions among ``names``. The one registry call also looks up every region this replica
        has open, and closes the objects of those no longer registered (or registered again since)."""
        names = set(names)
        if not names:
            return {}
        found = await self.registry.lookup(sorted(names | set(self.maps.names())))
        self.maps.keep_only(found)
        return {n: r for n, r in found.items() if n in names}

    async def sweep(self) -> None:
        """Close the objects of regions unregistered since this replica opened them: through another ingress
        replica, or by a shutdown (called every second by the tier replica's report loop, so an unregistered
        region's memory is not kept allocated here — until this replica's next request, as before, or for good
        when none comes). One registry call, only while this replica has a region open."""
        if len(self.maps):
            self.maps.keep_only(await self.registry.lookup(self.maps.names()))

    def close(self) -> None:
        """Unmap every region here."""
        self.maps.close()

    async def shutdown(self) -> None:
        """Server shutdown: unregister every region, unmap them, end the registry actor (best effort)."""
        stop = getattr(self.registry, "shutdown", None)  # the actor's (ActorRegistry.shutdown)
        try:
            if stop is not None:
                await stop()
            else:
                await self.registry.unregister(None)
                await self.registry.unregister(None, "cuda")
        except Exception:  # noqa: BLE001 - the registry is gone already
            pass
        self.close()

    # -- HTTP ----------------------------------------------------------------------------------------------------
    async def route(self, method: str, rest: list[str], peer: str | None, read_body, kind: str = "system"):
        """Answer ``/v2/systemsharedmemory/<rest>`` (``kind`` ``"system"``) or ``/v2/cudasharedmemory/<rest>``
        (``"cuda"``): ``region/NAME/register`` (POST ``{"key", "offset", "byte_size"}``; CUDA: ``{"raw_handle":
        {"b64"}, "device_id", "byte_size"}``), ``region/NAME/unregister``, ``unregister`` (POST),
        ``region/NAME/status``, ``status`` (GET). Returns a :class:`ortcapture.serving.routes.Response`; refusals
        are 400 (404 an unknown path, 405 a wrong method)."""
        from ortcapture.serving.routes import error, json_response

        name = None
        if len(rest) == 3 and rest[0] == "region":
            name, op = rest[1], rest[2]
        elif len(rest) == 1:
            op = rest[0]
        else:
            return error(404, f"unknown endpoint: /v2/{kind}sharedmemory/[region/NAME/]{{register,unregister,"
                              "status}")
        want = "GET" if op == "status" else "POST"
        if op not in ("register", "unregister", "status") or (op == "register" and name is None):
            return error(404, f"unknown shared memory endpoint {'/'.join(rest)[:100]!r}")
        if method != want:
            return error(405, f"this endpoint takes {want}")
        try:
            if op == "status":
                return json_response(200, await self.status(name, kind))
            if op == "unregister":
                await self.unregister(name, kind)
                return json_response(200, {})
            fields = ("raw_handle", "device_id", "byte_size") if kind == "cuda" else ("key", "offset", "byte_size")
            body = await read_body(64 * 1024)
            try:
                req = json.loads(body or b"{}")
            except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's recursion limit
                raise ShmError(f"the register request is not valid JSON: send {{{', '.join(fields)}}}") from None
            if not isinstance(req, dict) or fields[0] not in req or "byte_size" not in req:
                raise ShmError(f"the register request must be a JSON object with {fields[0]!r} and 'byte_size' "
                               f"(and {fields[1]!r})")
            if kind == "cuda":
                await self.register_cuda(name, req["raw_handle"], req.get("device_id", 0), req["byte_size"], peer)
            else:
                await self.register(name, req["key"], req.get("offset", 0), req["byte_size"], peer)
            return json_response(200, {})
        except ShmError as exc:
            return error(400, str(exc))

    async def prepare_http(self, body: bytes, header_length, spec: protocol.ModelSpec):
        """An ``/infer`` body with the bytes of every input that names a region put in its place (as binary data),
        the regions of requested outputs checked; returns ``(body, header_length, plan)`` — the same body and
        ``None`` when no tensor names a region; when the body carried no binary bytes of its own, the JSON header
        alone with the inputs' bytes in ``plan.pieces`` (for ``parse_infer_request(..., pieces=plan.pieces)``).
        What the protocol refuses anyway is left for :func:`ortcapture.serving.protocol.parse_infer_request` to
        say."""
        head_end = len(body) if header_length is None else None
        if head_end is None:
            try:
                head_end = int(str(header_length).strip())
            except ValueError:
                return body, header_length, None
            if not 0 <= head_end <= len(body):
                return body, header_length, None
        if shm.REGION.encode() not in body[:head_end]:
            return body, header_length, None
        try:
            req = json.loads(body[:head_end])
        except (ValueError, RecursionError):  # the protocol's parser says what is wrong with it
            return body, header_length, None
        if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
            return body, header_length, None
        names = [p[shm.REGION] for p in _tensor_params(req.get("inputs"), req.get("outputs"))
                 if isinstance(p.get(shm.REGION), str)]
        regions = await self.regions(names)
        binary = memoryview(body)[head_end:]
        pos, pieces = 0, []
        expected = _expected_bytes(req["inputs"], spec)
        plan = ShmPlan()
        specs = {s.name: s for s in spec.inputs}
        read: dict = {}
        from_body = False  # an input declares binary bytes of the body
        for t in list(req["inputs"]):
            params = t.get("parameters") if isinstance(t, dict) else None
            if isinstance(params, dict) and shm.uses_shm(params):
                where = f"input {str(t.get('name'))[:100]!r}"
                shm.region_only(where, "'data'" if "data" in t else "binary_data_size" if "binary_data_size" in params
                                else None)
                ref = shm.reference(params, where, regions)
                if ref.region.kind == "cuda":  # stays on the device: the session replica gathers it
                    plan.add_input(str(t.get("name")), cuda_shm.device_tensor(ref, t, specs, where))
                    req["inputs"].remove(t)
                    continue
                check_input_ref(ref, t.get("name"), expected.get(t.get("name")), spec, read)
                data = self.maps.read(ref)
                t["parameters"] = {k: v for k, v in params.items() if k not in shm.PARAMETERS}
                t["parameters"]["binary_data_size"] = len(data)
                pieces.append(data)
            elif isinstance(params, dict) and isinstance(params.get("binary_data_size"), int):
                size = max(0, params["binary_data_size"])
                pieces.append(binary[pos:pos + size])
                pos += size
                from_body = True
        pieces.append(binary[pos:])  # bytes no input declares: the protocol says so
        try:
            for o in req.get("outputs") or []:
                params = o.get("parameters") if isinstance(o, dict) else None
                if isinstance(params, dict) and shm.uses_shm(params):
                    where = f"output {str(o.get('name'))[:100]!r}"
                    self.add_output(plan, str(o.get("name")), shm.reference(params, where, regions), spec)
                    o["parameters"] = {k: v for k, v in params.items() if k not in shm.PARAMETERS}
        except BaseException:
            plan.close()  # the output regions opened before the one refused
            raise
        head = json.dumps(req).encode()
        if not len(binary) and not from_body:  # every binary input from a region: its pieces, no joined copy
            plan.pieces = pieces[:-1]
            return head, str(len(head)), plan
        return head + b"".join(bytes(p) for p in pieces), str(len(head)), plan

    def write_outputs(self, plan: "ShmPlan", outputs: Mapping[str, Any], spec: protocol.ModelSpec) -> list[dict]:
        """Write the model's outputs that ``plan`` sends to regions; returns their response entries (name,
        datatype, shape and the region's parameters). :class:`ShmError` for an output larger than its
        ``shared_memory_byte_size`` (nothing is written past it)."""
        import numpy as np

        specs = {s.name: s for s in spec.outputs}
        entries = []
        for name, ref in plan.outputs.items():
            a = np.asarray(outputs[name])
            datatype = specs[name].datatype if name in specs else protocol.datatype_of(a.dtype)
            wire = a.dtype if datatype == "BF16" else np.dtype(protocol.DATATYPES[datatype])
            blob = np.ascontiguousarray(a, dtype=wire)
            self.maps.write(ref, blob, f"output {name!r}", plan.fds.get(name))
            entries.append({"name": name, "datatype": datatype, "shape": [int(d) for d in a.shape],
                            "parameters": {shm.REGION: ref.region.name, shm.OFFSET: ref.offset,
                                           shm.BYTE_SIZE: int(blob.nbytes)}})
        return entries

    def add_output(self, plan: "ShmPlan", name: str, ref: Ref, spec: protocol.ModelSpec) -> None:
        """:meth:`ShmPlan.add_output`, a system region's object opened for the request now (:meth:`Maps.pin`): its
        output goes to the object registered when the request was checked, whatever happens to the name before
        the output is written."""
        plan.add_output(name, ref, spec)
        if ref.region.kind != "cuda" and name not in plan.fds:
            plan.fds[name] = self.maps.pin(ref.region)  # ProtocolError 503 when out of descriptors

    def finish_http(self, plan: "ShmPlan", outputs: Mapping[str, Any], spec: protocol.ModelSpec,
                    payload: bytes, headers: dict) -> tuple[bytes, dict]:
        """The ``/infer`` response with the outputs ``plan`` sends to regions written there and listed (without
        data) in its JSON."""
        entries = self.write_outputs(plan, outputs, spec) + plan.device_entries(outputs)
        n = int(headers.get(protocol.HEADER_LENGTH, len(payload)))
        head = json.loads(payload[:n])
        head["outputs"] = head.get("outputs", []) + entries
        raw = json.dumps(head, allow_nan=False).encode()
        if protocol.HEADER_LENGTH not in headers:
            return raw, headers
        return raw + payload[n:], {**headers, protocol.HEADER_LENGTH: str(len(raw))}


@dataclass
class ShmPlan:
    """What an infer request keeps in shared memory: ``outputs`` ``{output name: checked Ref}`` written to system
    regions here; ``device_inputs`` ``{input name: DeviceTensor}`` and ``device_outputs`` ``{output name: (Ref,
    datatype)}`` in CUDA regions (:mod:`ortcapture.serving.cuda_shm`: read and written by the session replica)."""

    outputs: dict[str, Ref] = field(default_factory=dict)
    device_inputs: dict[str, cuda_shm.DeviceTensor] = field(default_factory=dict)
    device_outputs: dict[str, tuple[Ref, str]] = field(default_factory=dict)
    #: ``{output name: descriptor}`` of the system regions' objects, opened when the request was checked
    #: (:meth:`ShmStore.add_output`); :meth:`close` closes them
    fds: dict[str, int] = field(default_factory=dict)
    #: the binary inputs as pieces, one per input in input order, when every one came from a system region (the
    #: body carried no binary bytes): :meth:`ShmStore.prepare_http` then returns the JSON header alone, for
    #: :func:`~ortcapture.serving.protocol.parse_infer_request`'s ``pieces=`` (no joined copy of the tensors)
    pieces: list | None = None

    def close(self) -> None:
        """Close the descriptors the plan holds (idempotent; also when the plan is collected)."""
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        self.close()

    def __bool__(self) -> bool:
        return bool(self.outputs or self.device_inputs or self.device_outputs)

    def add_input(self, name: str, tensor: cuda_shm.DeviceTensor) -> None:
        """An input in a CUDA region (:class:`ShmError` for a name given twice)."""
        if name in self.device_inputs:
            raise ShmError(f"input {name[:100]!r} appears twice")
        self.device_inputs[name] = tensor

    def add_output(self, name: str, ref: Ref, spec: protocol.ModelSpec) -> None:
        """A requested output's checked region reference, by the region's kind."""
        if ref.region.kind != "cuda":
            self.outputs[name] = ref
            return
        specs = {s.name: s.datatype for s in spec.outputs}
        if name not in specs:
            raise ShmError(f"output {name[:100]!r}: the model has no such output")
        self.device_outputs[name] = (ref, specs[name])

    def take_outputs(self, request: protocol.InferRequest) -> None:
        """Leave the outputs that go to regions out of ``request``'s response tensors, and put the inputs in CUDA
        regions into its feeds."""
        request.outputs = [(n, b) for n, b in request.outputs if n not in self.outputs and n not in
                           self.device_outputs]
        twice = [n for n in self.device_inputs if n in request.inputs]
        if twice:
            raise ShmError(f"input {twice[0]!r} appears twice")
        request.inputs.update(self.device_inputs)

    def infer_kwargs(self) -> dict:
        """What the ingress's ``infer`` takes besides the feeds: ``{"device_outputs": {name: Ref}}`` or ``{}``."""
        return {"device_outputs": {n: r for n, (r, _) in self.device_outputs.items()}} if self.device_outputs else {}

    def device_entries(self, outputs: Mapping[str, Any]) -> list[dict]:
        """The response entries of the outputs the session replica wrote into CUDA regions."""
        return cuda_shm.region_entries(outputs, self.device_outputs)


def _tensor_params(*lists):
    for lst in lists:
        for t in lst if isinstance(lst, list) else []:
            p = t.get("parameters") if isinstance(t, dict) else None
            if isinstance(p, dict):
                yield p


def expected_bytes(name, datatype, shape, spec: protocol.ModelSpec) -> int | None:
    """The bytes input ``name`` of ``datatype`` and ``shape`` takes, when it is one of the model's inputs with its
    datatype, its rank and a shape of integers >= 0; ``None`` otherwise (the protocol says what is wrong). The one
    computation for REST and gRPC inputs in system regions (:func:`check_input_ref`)."""
    s = {t.name: t for t in spec.inputs}.get(name)
    if s is None or datatype != s.datatype or not isinstance(shape, (list, tuple)) or len(shape) != len(s.shape):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return None
    n = s.dtype.itemsize
    for d in shape:
        n *= int(d)
    return n


def _expected_bytes(inputs, spec: protocol.ModelSpec) -> dict:
    """``{input name: bytes}`` (:func:`expected_bytes`) of a REST request's inputs that have one."""
    out = {}
    for t in inputs:
        if isinstance(t, dict):
            n = expected_bytes(t.get("name"), t.get("datatype"), t.get("shape"), spec)
            if n is not None:
                out[t["name"]] = n
    return out


def check_input_ref(ref: Ref, name, expected: int | None, spec: protocol.ModelSpec, read: dict) -> None:
    """The one check of input ``name`` read from a system region, before a byte is read (REST and gRPC): its
    ``shared_memory_byte_size`` is what its shape and datatype take (``expected``; ``None``: not one of the model's
    inputs with its datatype and a shape of integers >= 0 — the region is not read at all, so a wrong datatype
    cannot make the server copy a whole large region); the request names it once, and its regions' bytes together
    stay within the request cap (``spec.max_body_bytes``, as for a body) — ``read``: this request's inputs read from
    regions so far, ``{name: bytes}``, updated here (a tester's 14 KB request naming one 16 MiB region 100 times
    made the ingress read 1.6 GB before the duplicate was refused). Raises :class:`ShmError`."""
    where = f"input {str(name)[:100]!r}"
    if name in read:
        raise ShmError(f"{where} appears twice")
    if expected is None:
        s = {t.name: t for t in spec.inputs}.get(name)
        raise ShmError(f"{where}: a shared memory input must be one of the model's inputs "
                       f"({[t.name for t in spec.inputs]})" if s is None else
                       f"{where}: a shared memory input needs datatype {s.datatype} and a shape of {len(s.shape)} "
                       "integers >= 0")
    if ref.byte_size != expected:
        raise ShmError(f"{where}: {shm.BYTE_SIZE} {ref.byte_size}; its shape and datatype take {expected} bytes")
    if expected + sum(read.values()) > spec.max_body_bytes:
        raise ShmError(f"{where}: {expected + sum(read.values())} bytes in all are past the cap of "
                       f"{spec.max_body_bytes} bytes a request may carry")
    read[name] = expected
