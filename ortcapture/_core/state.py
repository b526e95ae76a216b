"""Per-session capture state: the one owner of a session's graphs, registry, buffers and gate interaction.

Every :class:`~ortcapture.session.InferenceSession` holds one :class:`CaptureState` (a new one after
``set_providers``, which builds a new C session). A shape-specialised sibling session (capture-deferred models,
:mod:`ortcapture._ort.specialize`) has its own state whose :attr:`CaptureState.family` is the parent's: the family
state owns the ``gpu_graph_id`` space, the sibling sessions and the :class:`GraphPool` of
:class:`~ortcapture.graph.CapturedGraph` s; each member state owns the :class:`~ortcapture._core.registry.GraphRegistry` of
the graphs captured on its own C session.

The interface a :class:`~ortcapture.graph.CapturedGraph` uses (and nothing else of the session):
:attr:`~CaptureState.guard` / :attr:`~CaptureState.capture_guard`, :meth:`~CaptureState.new_buffer`,
:meth:`~CaptureState.run_uncaptured`, :meth:`~CaptureState.capture`, :meth:`~CaptureState.replay`,
:meth:`~CaptureState.ensure_thread`, :attr:`~CaptureState.capture_probe` / :meth:`~CaptureState.check_foreign_capture`
and :meth:`~CaptureState.release`.

Data flow of a replay: feeds -> :func:`ortcapture.transfer.copy_feeds` (validate, copy into the graph's fixed
buffers) -> :meth:`CaptureState.replay` (pinned record) -> :func:`ortcapture._core.run.run_bound` (ORT) -> outputs.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterator, Sequence

from ortcapture._ort import compat
from ortcapture._memory.buffers import BufferPool, allocate
from ortcapture._memory.ledger import DeviceLedger
from ortcapture._ort.providers import CUDA_EPS, CaptureInfo
from ortcapture._core.reference import check_frozen
from ortcapture._core.registry import FIRST_AUTO_ID, CapturedGraphRecord, GraphRegistry
from ortcapture._core.run import bound_runner, run_bound, uncaptured_run_options
from ortcapture._ort.sync import NO_DEVICE, WEBGPU_LOCK, CaptureGuard, Origin, SessionGuard
from ortcapture.errors import CaptureError

#: WebGPU: replays of one graph between two queue drains (a host readback of its smallest output). ORT's WebGPU
#: ``run_with_iobinding`` returns before the GPU finishes, and nothing bounds the queue: measured on the software
#: adapter (ORT 1.32, plugin 0.4.0), 30,000 ``run(copy_outputs=False)`` replays of a 64x64 recurrent Add/Mul with
#: no readback grew host RSS by 155 MiB (5.3 KB a replay: submitted, not yet executed work);
#: ``IOBinding.synchronize_outputs()`` does not wait for it; a readback every 256 replays keeps the backlog under
#: ~1.5 MiB (flat RSS).
WEBGPU_DRAIN_EVERY = 256


class GraphPool:
    """The live :class:`~ortcapture.graph.CapturedGraph` s of one session family, by ``gpu_graph_id``.

    Graphs are held weakly: a graph dropped by its user is collected, and its id comes back from
    :meth:`take_collected` so that the session releases it. (Which graph serves a feed is decided by its owner — a
    captured graph by its user, a bucket by the bucket runner — not looked up here: the key-to-graph lookups this pool
    once offered had no caller, issue 42.)
    """

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ReferenceType] = {}
        self._collected: list[tuple[int, weakref.ReferenceType]] = []
        self._lock = threading.Lock()

    def add(self, graph) -> None:
        """Register ``graph`` (its ``graph_id`` must be free in the pool)."""
        gid = graph.graph_id
        collected = self._collected

        def on_collect(ref, gid=gid):
            collected.append((gid, ref))

        with self._lock:
            self._refs[gid] = weakref.ref(graph, on_collect)

    def pop(self, graph_id: int):
        """Forget ``graph_id``; return its graph when still alive."""
        with self._lock:
            ref = self._refs.pop(graph_id, None)
        return ref() if ref is not None else None

    def __contains__(self, graph_id: int) -> bool:
        return graph_id in self._refs

    def ids(self) -> list[int]:
        """Every registered id (live or collected but not yet taken)."""
        return list(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def graphs(self) -> list:
        """The live graphs, by id."""
        with self._lock:
            refs = sorted(self._refs.items())
        return [g for _, ref in refs if (g := ref()) is not None]

    def take_collected(self) -> list[int]:
        """Ids whose graph was garbage-collected without ``release()`` since the last call (now forgotten)."""
        out = []
        while self._collected:
            gid, ref = self._collected.pop()
            with self._lock:
                if self._refs.get(gid) is ref:
                    del self._refs[gid]
                    out.append(gid)
        return out

    def clear(self) -> list:
        """Forget every graph; return the live ones."""
        live = self.graphs()
        with self._lock:
            self._refs.clear()
        return live


class CaptureState:
    """What one session knows about capture (see the module docstring).

    Args:
        session: the :class:`~ortcapture.session.InferenceSession` (its C session is the one that captures).
        info: the capture the session really does (``None``: it does not capture).
        requested: the capture its providers asked for (``None``: none).
        deferred: capture was requested but ORT refused it for the model's dynamic dims; shape-specialised siblings
            capture instead.
        static_shapes: the shape signature the session was specialised to, or ``None``.
        lock: the session's lock; replaced by the process-wide WebGPU lock for WebGPU sessions (ORT's WebGPU queue is
            not thread-safe).
        family: the parent's state for a shape-specialised sibling; ``None`` for a session the user made.
        origin: where the session's C session was made (:class:`ortcapture._ort.sync.Origin`; ``None``: no device EP).
            In an ``os.fork()`` child of that process every guard entry raises ``CaptureError``.
    """

    def __init__(self, session, info: CaptureInfo | None, requested: CaptureInfo | None, deferred: bool,
                 static_shapes: tuple | None, lock, family: "CaptureState | None" = None,
                 origin: Origin | None = None) -> None:
        self.session = session
        #: where the session's C session was made; ``origin.forked``: this is an os.fork() child of that process
        #: (graphs test ``FORKED_DEVICES and origin.forked`` before any native call, the guards on every entry)
        self.origin = origin if origin is not None else NO_DEVICE
        self.info = info
        self.requested = requested
        self.deferred = deferred
        self.static_shapes = static_shapes
        self.family = family if family is not None else self
        want = info or requested
        active = session.get_providers()
        webgpu = (want is not None and want.device_type == "webgpu") or "WebGpuExecutionProvider" in active
        cuda = (want is not None and want.device_type == "cuda") or any(p in CUDA_EPS for p in active)
        self.lock = WEBGPU_LOCK if webgpu else lock
        #: uncaptured GPU runs are guarded too: CUDA ones must not overlap another thread's capture, WebGPU ones no
        #: other WebGPU work
        self.gpu_guarded = cuda or webgpu
        #: ``with state.guard:`` — ``CUDA_GATE.shared`` (CUDA sessions), then the session lock
        self.guard = SessionGuard(self.lock, cuda, self.origin)
        #: ``with state.capture_guard:`` — ``CUDA_GATE.exclusive`` (CUDA sessions), then the session lock
        self.capture_guard = CaptureGuard(self.lock, cuda, self.origin)
        # ORT's CUDA/TensorRT EPs keep captured graphs per thread (CUDAExecutionProvider::PerThreadContext)
        self.per_thread = info is not None and info.device_type == "cuda"
        #: replays between two WebGPU queue drains (0: never; see WEBGPU_DRAIN_EVERY)
        self.drain_every = WEBGPU_DRAIN_EVERY if info is not None and info.device_type == "webgpu" else 0
        #: per thread: ``graphs``, the ids captured in the thread (CUDA graphs are per thread; read inline by replays)
        self.tls = threading.local()
        #: ``probe() -> bool``: is a foreign CUDA graph capture in progress that a replay would break (a blocking
        #: stream of the calling thread's current CUDA context, or torch's current stream; ORT PR #32081)?
        #: See make_capture_probe
        self.capture_probe = None
        if info is not None and info.device_type == "cuda":
            from ortcapture._ort.cudart import make_capture_probe

            self.capture_probe = make_capture_probe()
        #: where fixed buffers live: the capturing EP's device (the requested one for a deferred session)
        self.device: CaptureInfo | None = info or (requested if deferred else None)
        self.registry = GraphRegistry(info) if info is not None else None
        self.pool = BufferPool(session, self.device) if self.device is not None else None
        # family-level: set on the family state only
        self.graphs = GraphPool()
        #: graphs released or forgotten so far (release, reset), counted on the family state, in all and per thread
        #: (:meth:`release_mark`, :meth:`released_elsewhere`)
        self.releases = 0
        self.release_lock = threading.Lock()
        #: ``(id of the C session, inputs ORT reads on the host, input specs)`` for the checks of plain runs
        #: (:mod:`ortcapture._session.plain`), made again when the C session is another (dropped by reset, rebuilt)
        self.plain_inputs: tuple | None = None
        self.releases_here = threading.local()
        self.siblings: dict[tuple, CaptureState] = {}  # shape signature -> the sibling session's state
        #: ``() -> frozenset``: outputs whose value depends on no input (set by the session; ortcapture._verify.inspect)
        self.constant_outputs = frozenset
        #: the family's graph device memory and compaction threshold (:mod:`ortcapture._memory.compact`), shared by members
        self.ledger = family.ledger if family is not None else DeviceLedger()
        #: ``() -> None``: rebuild this member's C session (same model, options, providers); set by the session
        self.rebuild_session = None
        #: ``(what) -> None``: raise CaptureError when the model's external data changed since construction (set by
        #: the session; ortcapture._ort.model)
        self.check_model = None
        #: ``() -> (stream, event, device) | None``: the CUDA EP's compute stream (an int), an event of its device
        #: and the device ordinal, for feed copies queued ahead of a replay (ortcapture._ort.compute_stream); set by
        #: the session
        self.compute_stream = None
        if family is not None and info is not None and static_shapes is not None:
            family.siblings[static_shapes] = self  # a shape-specialised sibling joins its family

    # -- family ---------------------------------------------------------------------------------------------
    def members(self) -> Iterator["CaptureState"]:
        """This state and its shape-specialised siblings' states (call on the family state)."""
        yield self
        yield from list(self.siblings.values())

    def owner_of(self, graph_id: int) -> "CaptureState | None":
        """The member state whose registry holds ``graph_id`` (call on the family state)."""
        for st in self.members():
            if st.registry is not None and graph_id in st.registry:
                return st
        return None

    def free_id(self) -> int:
        """The smallest ``gpu_graph_id`` >= 1 that no member captured or retired and no graph holds (id 0 is what a
        raw run without a ``gpu_graph_id`` uses)."""
        taken: set[int] = set(self.graphs.ids())
        for st in self.members():
            if st.registry is not None:
                taken.update(st.registry.graph_ids)
                taken.update(st.registry.retired_ids)
        gid = FIRST_AUTO_ID
        while gid in taken:
            gid += 1
        return gid

    def check_free(self, graph_id: int) -> None:
        """Raise unless ``graph_id`` may be captured in this family (call on the family state)."""
        from ortcapture.errors import GraphReleasedError

        if graph_id < 0:
            raise CaptureError(f"gpu_graph_id must be >= 0 to capture, got {graph_id} (-1 means 'no capture')")
        for st in self.members():
            if st.registry is None:
                continue
            if graph_id in st.registry:
                raise CaptureError(f"gpu_graph_id={graph_id} is already captured; release it or pick another id")
            if graph_id in st.registry.retired_ids:
                raise GraphReleasedError(st.registry.retired_text(graph_id) + ".")

    def release_collected(self) -> None:
        """Release the graphs whose CapturedGraph was garbage-collected without ``release()`` (call on the family
        state, outside any guard: it takes each member's own)."""
        for gid in self.graphs.take_collected():
            owner = self.owner_of(gid)
            if owner is not None:
                owner.release(gid)

    # -- buffers --------------------------------------------------------------------------------------------
    def new_buffer(self, shape: Sequence[int], dtype):
        """A fixed device OrtValue on :attr:`device` that the caller owns (a CapturedGraph's buffers). Raises
        :class:`~ortcapture.errors.TransferError` for a bad shape or dtype."""
        with self.guard:  # a device allocation must not happen while another thread captures (CUDA)
            return allocate(self.session, self.device, shape, dtype)

    # -- running --------------------------------------------------------------------------------------------
    def run_uncaptured(self, binding) -> None:
        """One run of ``binding`` with ``gpu_graph_id=-1`` (no capture, no replay); the caller holds a guard."""
        run_bound(self.session, binding, uncaptured_run_options())

    def capture(self, binding, graph_id: int, run_options, owner=None) -> CapturedGraphRecord:
        """Capture ``graph_id`` with ``binding`` side-effect free, verify it and pin it
        (:func:`ortcapture._core.capture.capture_bindings`). The caller holds :attr:`capture_guard`."""
        from ortcapture._core.capture import capture_bindings

        with self.ledger.measure(graph_id, self.info):
            rec = capture_bindings(self, binding, graph_id, run_options, owner)
        self._thread_add(graph_id)
        return rec

    def replay(self, binding, run_options, record: CapturedGraphRecord) -> None:
        """The hot path: replay a pinned, validated graph. The caller holds :attr:`guard`, has checked for a
        foreign capture and has called :meth:`ensure_thread`."""
        if record.frozen:  # host-read inputs bound with bind_cpu_input: capture-time constants
            check_frozen(record.frozen, {n: record.inputs[n].value for n in record.frozen})
        run_bound(self.session, binding, run_options)
        record.replays += 1
        if self.drain_every and not record.replays % self.drain_every:
            _drain(record, binding)

    def replayer(self, binding, run_options, record: CapturedGraphRecord):
        """:meth:`replay` of ``binding`` decided once: a callable ``replay()`` doing exactly what :meth:`replay`
        does for these arguments (a graph rebuilds it whenever its binding, run options or record change). Without
        host-read ``bind_cpu_input`` values to check and without WebGPU queue drains it is ORT's call and the
        count alone."""
        if record.frozen:
            return lambda: self.replay(binding, run_options, record)
        run = bound_runner(self.session, binding, run_options)
        drain = self.drain_every
        if drain:
            def replay() -> None:
                run()
                record.replays += 1
                if not record.replays % drain:
                    _drain(record, binding)
            return replay

        def replay() -> None:
            run()
            record.replays += 1
        return replay

    def replay_parts(self, binding, run_options, record: CapturedGraphRecord):
        """``(run, record)`` where :meth:`replayer`'s replay is ORT's bound call plus ``record.replays += 1`` (the
        caller does both, saving a Python frame on the hot path); ``(None, None)`` where it does more (host-read
        ``bind_cpu_input`` values to check, WebGPU queue drains)."""
        if record.frozen or self.drain_every:
            return None, None
        return bound_runner(self.session, binding, run_options), record

    # ORT's CUDA/TensorRT EPs keep captured graphs per thread: a captured id run from a new thread would re-run the
    # warm-ups (state advances) and capture again, racing other threads' CUDA work.
    def thread_has(self, graph_id: int) -> bool:
        """Whether the calling thread may replay ``graph_id`` now (always True off CUDA)."""
        if not self.per_thread:
            return True
        graphs = getattr(self.tls, "graphs", None)
        return graphs is not None and graph_id in graphs

    def _thread_add(self, graph_id: int) -> None:
        if self.per_thread:
            graphs = getattr(self.tls, "graphs", None)
            if graphs is None:
                graphs = self.tls.graphs = set()
            graphs.add(graph_id)

    def ensure_thread(self, binding, graph_id: int, run_options) -> bool:
        """Before a replay of ``graph_id`` from this thread: give the thread its own ORT capture if it has none yet
        (:func:`ortcapture._core.capture.capture_in_this_thread`). True when it did; False when the thread has it, or
        ``graph_id`` is not captured (the caller captures or raises). Raises like the registry's ``check`` for
        another IOBinding. Takes :attr:`capture_guard` itself."""
        if self.thread_has(graph_id):
            return False
        from ortcapture._core.capture import capture_in_this_thread

        with self.capture_guard:
            if self.thread_has(graph_id) or self.registry is None or graph_id not in self.registry:
                return False
            if self.registry.check(binding, graph_id) is None:  # pinned binding only
                return False
            with self.ledger.measure(graph_id, self.info):
                capture_in_this_thread(self, binding, run_options)
            self._thread_add(graph_id)
            return True

    def check_foreign_capture(self) -> None:
        """Raise :class:`CaptureError` when a foreign capture is in progress (ORT PR #32081; see
        :func:`ortcapture._ort.cudart.make_capture_probe` for what is seen)."""
        probe = self.capture_probe
        if probe is not None and probe():
            raise CaptureError(
                "a CUDA graph is being captured right now (torch's current stream, e.g. inside torch.cuda.graph(), "
                "or a blocking CUDA stream of the calling thread's current device, in any thread): CUDA work of an "
                "ORT CUDA-graph session now is unsafe (inside torch.cuda.graph() it ends in std::terminate, ORT PR "
                "#32081). Run the ORT session outside the foreign capture."
            )

    # -- release / reset ------------------------------------------------------------------------------------
    def release(self, graph_id: int, aborted: bool = False) -> None:
        """Release ``graph_id`` on this member: unpin it, free it in ORT where ORT can (WebGPU; CUDA/TensorRT ids
        are retired instead; ``aborted``: its capture was interrupted, and a retry of the id is told so), and detach
        the CapturedGraph that owned it."""
        with self.guard:
            rec = self.registry.release(graph_id, aborted) if self.registry is not None else None
            if rec is not None:
                self._count_release()  # a graph there was (an unknown id counts for nothing)
                self.ledger.released(graph_id, freed=self.info.releases_natively, pinned_bytes=rec.nbytes)
            if compat.has_release_captured_graph():
                compat.OrtInferenceSession.release_captured_graph(self.session, graph_id)
            graph = self.family.graphs.pop(graph_id)
            owner = rec.owner() if rec is not None and rec.owner is not None else None
            for g in (graph, owner):  # usually the same graph; detach() is idempotent
                if g is not None:
                    g.detach()

    def _count_release(self) -> None:
        fam = self.family
        with fam.release_lock:
            fam.releases += 1
        fam.releases_here.n = getattr(fam.releases_here, "n", 0) + 1

    def release_mark(self) -> tuple[int, int]:
        """``(graphs of the family released so far, those released by the calling thread)``: the mark
        :meth:`released_elsewhere` compares with."""
        fam = self.family
        return fam.releases, getattr(fam.releases_here, "n", 0)

    def released_elsewhere(self, mark: tuple[int, int]) -> bool:
        """Whether another thread released graphs of the family since ``mark`` (:meth:`release_mark`): a capture
        that failed meanwhile may have failed because its graph was released under it (``release_captured_graph``,
        ``set_providers`` from another thread) — a passing fault, not a refusal to remember. Releases of the calling
        thread itself (a failed check releasing its own graph) do not count."""
        total, mine = self.release_mark()
        return total - mark[0] > mine - mark[1]

    def reset(self) -> None:
        """Forget every graph of the family (the C sessions that held them are going: ``set_providers``) and detach
        the CapturedGraphs. The caller holds :attr:`capture_guard`."""
        self._count_release()
        self.plain_inputs = None
        for st in list(self.members()):
            if st.registry is not None:
                for rec in st.registry.reset():
                    owner = rec.owner() if rec.owner is not None else None
                    if owner is not None:
                        owner.detach()
        for g in self.graphs.clear():
            g.detach()
        self.siblings.clear()

    def rebuilt(self) -> None:
        """This member's C session was rebuilt (``InferenceSession.compact``): every graph it held and every retired
        id is gone, and no thread has a CUDA graph of it yet. The caller holds :attr:`capture_guard`."""
        self.registry = GraphRegistry(self.info)
        self.tls = threading.local()
        self.plain_inputs = None
        if self.pool is not None:
            self.pool.clear()

    def describe(self) -> dict[int, dict]:
        """``gpu_graph_id`` -> what it pinned (see ``InferenceSession.captured_graphs``), family-wide."""
        out = {}
        for st in self.members():
            if st.registry is None:
                continue
            for gid in st.registry.graph_ids:
                rec = st.registry.get(gid)
                if rec is None:  # released by another thread meanwhile
                    continue
                d = rec.describe()
                d["static_shapes"] = dict(st.static_shapes) if st.static_shapes else None
                out[gid] = d
        return out


def _drain(record, binding) -> None:
    """Wait for the WebGPU queue: read back the smallest output (see WEBGPU_DRAIN_EVERY) — the record's pinned
    outputs, or for a graph without capture (``uncaptured_graph()``: its record has none) its binding's outputs."""
    from ortcapture._ort.values import meta
    from ortcapture._transfer import copy as transfer

    values = [b.value for b in record.outputs.values() if b.value is not None] or list(binding.get_outputs())
    if values:
        transfer.to_numpy(min(values, key=lambda v: meta(v).nbytes))
