"""The only process-wide state of ortcapture: CUDA capture gate, WebGPU lock, unsettled runs, fork, settings, threads.

* :data:`CUDA_GATE`: a CUDA graph capture excludes every other ortcapture CUDA call (below).
* :data:`WEBGPU_LOCK`: one re-entrant lock for all WebGPU work of the process (sessions, captured or not, and
  copies share ORT's WebGPU device and queue, which are not thread-safe; measured on ORT 1.32: two WebGPU
  sessions, or a ``copy_tensors`` beside a replay, from two threads end in SIGSEGV or "CommandEncoder is already
  finished").
* :data:`UNSETTLED`: runs made with ``disable_synchronize_execution_providers=1``, settled before ortcapture's next
  transfer (:func:`settle`).
* :data:`FORKED_DEVICES` and every device session's :class:`Origin`: what a process made by ``os.fork()`` inherited
  from its parent, marked by the one ``os.register_at_fork`` hook of ortcapture (at the end of this module), so that a
  session made before the fork raises :class:`~ortcapture.errors.CaptureError` in the child instead of hanging.
* The settings: every ``ORTCAPTURE_*`` environment variable the library reads (:data:`COPY_BACKEND`,
  :data:`COMPUTE_STREAM`, :data:`STAGING_THREADS`, :data:`PINNED`, ...; docs/INSTALL.md lists them), each read once,
  at import; the modules that use them read them here at call time.
* The staging copy threads (:func:`staging_pool`): the process-wide thread pools pinned staging fills copy on.
* :data:`HOST_RANGES`: host memory its owner page-locked for feeds (:func:`ortcapture.transfer.pin_host_memory`).

Everything else ortcapture keeps lives in a session (:mod:`ortcapture._core.state`) or a graph. Caches that are
process-wide but only memoise facts (the installed ORT's features in :mod:`ortcapture._ort.compat`, peer access in
:mod:`ortcapture._ort.cudart`, DLPack wrappers in :mod:`ortcapture._transfer.sources`) hold no state a user can observe.

The CUDA capture gate in detail.

ORT's CUDA and TensorRT EPs capture with ``cudaStreamBeginCapture(..., cudaStreamCaptureModeGlobal)``: while one
thread captures, a "potentially unsafe" CUDA call from *any other thread* (``cudaMemcpy``, ``cudaMalloc``, a
stream synchronisation — what every run, replay and host copy does) fails and invalidates the capture. Measured on
two H200s with onnxruntime-gpu 1.31.1: a session capturing on GPU 1 while another thread replayed on GPU 0 failed
with ``CUDA failure 901: operation failed due to a previous error during capture`` (``cudaStreamEndCapture``).

So ortcapture treats CUDA work as readers and captures as writers of one process-wide gate (:data:`CUDA_GATE`):
replays, plain runs and copies of different sessions still run concurrently (one session per GPU, one thread
each), and a capture waits until they are out and keeps new ones out until it is done (writers first, so a busy
replay loop cannot starve it). Both sides are re-entrant per thread (a capture's own copies pass straight
through). Lock order everywhere: this gate first, then a session's lock. The reader fast path relies on the GIL;
free-threaded CPython takes a locked path (:data:`NO_GIL`).

CUDA work issued outside ortcapture (raw onnxruntime sessions, torch) is not covered: do not run it from other
threads while an ortcapture session captures.
"""
from __future__ import annotations

import os
import sys
import threading
import weakref

from ortcapture.errors import CaptureError

_get_ident = threading.get_ident
#: free-threaded CPython (PEP 703) with the GIL off: the gate's lock-free reader handshake relies on the GIL's
#: sequentially consistent loads and stores, so without it readers take the locked path
NO_GIL = not getattr(sys, "_is_gil_enabled", lambda: True)()


class _Slot:
    """One thread's view of the gate: nesting depth and whether it is inside CUDA work now."""

    __slots__ = ("ident", "thread", "depth", "active")

    def __init__(self) -> None:
        self.ident, self.thread = _get_ident(), threading.current_thread()
        self.depth, self.active = 0, False


class CaptureGate:
    """A writer-preferring, per-thread re-entrant readers/writer gate (see the module docstring).

    ``with gate.shared:`` around CUDA work; ``with gate.exclusive:`` around a capture. Raises
    :class:`RuntimeError` for misuse instead of corrupting its state: ``exclusive`` entered from a thread that is
    inside ``shared`` (it would wait for itself forever), an exit without an enter, ``exclusive`` left by a thread
    that does not hold it. Threads that die are forgotten (one that died inside a block no longer holds it).

    The reader fast path takes no lock (about 0.3 µs): a reader publishes ``active`` and then looks for a pending
    writer; a writer publishes ``pending`` and then waits until no other live thread is ``active``. Under the GIL
    these stores and loads are sequentially consistent, so either the reader sees the writer and backs off, or
    the writer sees the reader and waits for it (the Dekker handshake). On free-threaded CPython with the GIL off
    (:data:`NO_GIL`) readers take the condition's lock instead.
    """

    POLL_S = 0.05  # how often a waiter looks for a dead peer

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.writers = threading.Lock()  # one capture at a time
        self.pending = False  # a writer is waiting for readers to leave, or is inside
        self.writer: _Slot | None = None  # the slot of the thread inside exclusive (not its ident: idents are
        self.writer_depth = 0  # reused by new threads once a thread ends)
        self.slots: list[_Slot] = []  # every live thread that has entered
        self.tls = threading.local()
        self.shared = _Shared(self)
        self.exclusive = _Exclusive(self)

    @property
    def capturing(self) -> bool:
        """Whether some thread is inside ``exclusive`` now."""
        return self.writer is not None

    @property
    def readers(self) -> int:
        """Live threads inside ``shared`` now (the capturing thread's own work not counted)."""
        return sum(1 for s in list(self.slots) if s.active and s is not self.writer and s.thread.is_alive())

    def slot(self) -> _Slot:
        try:
            return self.tls.slot
        except AttributeError:
            slot = self.tls.slot = _Slot()
            with self.cond:
                self.slots = [s for s in self.slots if s.thread.is_alive()] + [slot]
            return slot

    def reap_dead_writer(self) -> None:
        """Caller holds ``cond``: a writer thread that died inside ``exclusive`` no longer holds it."""
        w = self.writer
        if w is not None and not w.thread.is_alive():
            self.writer = None
            self.writer_depth = 0
            self.pending = False
            self.writers.release()
            self.cond.notify_all()


class _Side:
    """One side of a :class:`CaptureGate` (``shared`` or ``exclusive``): a context manager over the gate."""

    __slots__ = ("_g",)

    def __init__(self, gate: CaptureGate) -> None:
        self._g = gate


class _Shared(_Side):
    __slots__ = ()

    def __enter__(self) -> None:
        g = self._g
        try:
            slot = g.tls.slot
        except AttributeError:
            slot = g.slot()
        if slot.depth:
            slot.depth += 1
            return
        slot.depth = 1
        if NO_GIL:
            try:
                with g.cond:
                    while g.pending and g.writer is not slot:
                        g.cond.wait(g.POLL_S)
                        g.reap_dead_writer()
                    slot.active = True
            except BaseException:
                slot.depth = 0
                raise
            return
        slot.active = True  # publish first, then look (see CaptureGate)
        if g.pending and g.writer is not slot:
            slot.active = False
            try:
                with g.cond:
                    g.cond.notify_all()  # a writer may be waiting on this thread
                    while g.pending:
                        g.cond.wait(g.POLL_S)
                        g.reap_dead_writer()
                    slot.active = True
            except BaseException:  # KeyboardInterrupt while waiting: leave no trace
                slot.depth, slot.active = 0, False
                raise

    def __exit__(self, *exc) -> None:
        g = self._g
        slot = getattr(g.tls, "slot", None)
        if slot is None or slot.depth <= 0:
            raise RuntimeError("ortcapture: CaptureGate.shared exited without being entered by this thread")
        slot.depth -= 1
        if not slot.depth:
            if NO_GIL:
                with g.cond:
                    slot.active = False
                    g.cond.notify_all()
                return
            slot.active = False
            if g.pending:
                with g.cond:
                    g.cond.notify_all()


class _Exclusive(_Side):
    __slots__ = ()

    def __enter__(self) -> None:
        g = self._g
        slot = g.slot()
        if g.writer is slot:
            g.writer_depth += 1
            return
        if slot.depth:
            raise RuntimeError("ortcapture: a CUDA graph capture was started from inside CUDA work of the same "
                               "thread (it would wait for itself); capture outside run/copy calls")
        while not g.writers.acquire(timeout=g.POLL_S):
            with g.cond:
                g.reap_dead_writer()
        try:
            with g.cond:
                g.pending = True
                while any(s.active and s is not slot and s.thread.is_alive() for s in g.slots):
                    g.cond.wait(g.POLL_S)
                g.writer, g.writer_depth = slot, 1
        except BaseException:  # KeyboardInterrupt while waiting for readers: undo, so the gate stays usable
            with g.cond:
                g.pending = False
                g.cond.notify_all()
            g.writers.release()
            raise

    def __exit__(self, *exc) -> None:
        g = self._g
        if g.writer is None or g.writer is not getattr(g.tls, "slot", None):
            raise RuntimeError("ortcapture: CaptureGate.exclusive exited by a thread that does not hold it")
        g.writer_depth -= 1
        if g.writer_depth == 0:
            with g.cond:
                g.writer = None
                g.pending = False
                g.cond.notify_all()
            g.writers.release()


#: The gate shared by every ortcapture CUDA/TensorRT session and CUDA copy in this process.
CUDA_GATE = CaptureGate()


class SessionGuard:
    """``with guard:`` = ``CUDA_GATE.shared`` then the session's lock (the one lock order used everywhere).
    For sessions whose EP is not CUDA-based it is just the lock.

    The replay hot path enters it on every call: the gate's reader fast path (the thread's first, unnested entry
    while no writer is pending) is done here inline, exactly as :class:`_Shared` does it, and every other case
    (nested, a pending writer, free-threaded CPython, the thread's first entry ever) is handed to the gate's own
    code.

    ``origin``: the session's :class:`Origin`; in an ``os.fork()`` child of the process that made the session,
    entering raises its :class:`~ortcapture.errors.CaptureError` before any lock is taken (a lock another thread of
    the parent held at the fork stays held in the child).

    ``inline``: ``(gate or None, lock, lock only)`` for a caller that inlines this reader fast path itself
    (``CapturedGraph.run``): the gate whose fast path it may take (``None``: never), the session's lock, and whether
    the guard is that lock alone (no CUDA gate). Fixed at construction, read once per call."""

    __slots__ = ("_lock", "_gate", "_cg", "_origin", "inline")

    def __init__(self, lock, cuda: bool, origin: "Origin | None" = None) -> None:
        self._lock = lock
        self._gate = CUDA_GATE.shared if cuda else None
        self._cg = CUDA_GATE if cuda and not NO_GIL else None  # the inline reader fast path's gate
        self._origin = origin if origin is not None else NO_DEVICE
        self.inline = (self._cg, self._lock, self._gate is None)

    @property
    def origin(self) -> "Origin":
        """The session's :class:`Origin` (checked on every entry)."""
        return self._origin

    @property
    def holds_cuda_gate(self) -> bool:
        """Whether ``with guard:`` holds :data:`CUDA_GATE` (shared or exclusive) inside the block."""
        return self._gate is not None

    def __enter__(self) -> None:
        if FORKED_DEVICES and self._origin.forked:  # an os.fork() child: the parent's device state (see Origin)
            raise self._origin.error()
        g = self._cg
        if g is not None:
            slot = getattr(g.tls, "slot", None)
            if slot is not None and not slot.depth and not g.pending:  # _Shared.__enter__'s fast path
                slot.depth = 1
                slot.active = True  # publish first, then look (see CaptureGate)
                if g.pending:  # a writer came meanwhile: back out, and take the gate's own path
                    slot.depth, slot.active = 0, False
                    self._gate.__enter__()
            else:
                self._gate.__enter__()
        elif self._gate is not None:
            self._gate.__enter__()
        try:
            self._lock.acquire()
        except BaseException:
            if self._gate is not None:
                self._gate.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        self._lock.release()
        g = self._cg
        if g is not None:
            slot = getattr(g.tls, "slot", None)
            if slot is not None and slot.depth == 1:  # _Shared.__exit__ of the outermost entry
                slot.depth = 0
                slot.active = False
                if g.pending:
                    with g.cond:
                        g.cond.notify_all()
                return
        if self._gate is not None:
            self._gate.__exit__(*exc)


class CaptureGuard(SessionGuard):
    """``CUDA_GATE.exclusive`` then the session's lock: around a capture."""

    __slots__ = ()

    def __init__(self, lock, cuda: bool, origin: "Origin | None" = None) -> None:
        self._lock = lock
        self._gate = CUDA_GATE.exclusive if cuda else None
        # no inline path (SessionGuard's enter/exit then take the gate's own code): the writer's side is the gate's
        self._cg = None
        self._origin = origin if origin is not None else NO_DEVICE
        self.inline = (self._cg, self._lock, self._gate is None)


#: One lock for all WebGPU work of the process (see the module docstring). Re-entrant.
WEBGPU_LOCK = threading.RLock()


def run_async_guarded(guard, start, callback, user_data) -> None:
    """ORT's ``run_async`` serialised by ``guard`` (a :class:`SessionGuard` or a lock), for work ORT does on its own
    threads: a thread-owned lock (the WebGPU ``RLock``, the gate's per-thread reader slot) cannot be released by ORT's
    callback thread, so a helper thread takes ``guard``, calls ``start(done)`` (which calls ORT's ``run_async`` with
    ``done`` as its callback), holds ``guard`` until ``done`` ran, leaves it, then calls
    ``callback(outputs, user_data, err)`` with what ORT gave ``done``. Returns once ``start`` returned; re-raises
    what ``start`` raised (ORT's own synchronous errors: missing inputs, feeds it cannot convert)."""
    queued = threading.Event()
    raised: list = []

    def helper() -> None:
        finished = threading.Event()
        result: list = []

        def done(outputs, _user_data, err) -> None:
            result.append((outputs, err))
            finished.set()

        try:
            with guard:
                try:
                    start(done)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    raised.append(exc)
                    return
                finally:
                    queued.set()
                finished.wait()
        except BaseException as exc:  # noqa: BLE001 - the guard itself failed
            if not queued.is_set():
                raised.append(exc)
                queued.set()
                return
            raise
        outputs, err = result[0]
        callback(outputs, user_data, err)

    threading.Thread(target=helper, name="ortcapture-run-async", daemon=True).start()
    queued.wait()
    if raised:
        raise raised[0]


# -- runs that returned before their device work finished ----------------------------------------------------------
# With the run option ``disable_synchronize_execution_providers=1`` ORT's run returns as soon as the work is queued
# (CUDA: on ORT's own non-blocking stream). ortcapture's readers and writers (``transfer.to_numpy``,
# ``update_inplace``, ``copy``; ``CapturedGraph.run``'s feeds and outputs) go through other streams or the host, so
# they would race the replay (measured on the H200: 11 of 12 ``to_numpy`` reads right after such a replay saw an
# unfinished one). Such runs are recorded here and settled — ORT's ``IOBinding.synchronize_outputs()``, which syncs
# the EPs that produce the outputs — before ortcapture next touches any buffer. Strong references: a binding's
# buffers stay alive until its pending work is known to be done.
UNSETTLED: list = []  # [(IOBinding, "cuda" | "webgpu")]


def defer_sync(binding, kind: str) -> None:
    """Record that ``binding``'s last run may still be running on the device (``kind``: its EP's device kind). One
    entry per binding (a loop of such runs read by other means never grows the list)."""
    if not any(b is binding for b, _ in UNSETTLED):
        UNSETTLED.append((binding, kind))


def settle() -> None:
    """Wait for every run recorded by :func:`defer_sync` (callers test ``if UNSETTLED:`` first: the hot path pays a
    list truth test). An item leaves the list only after its synchronisation, so a concurrent caller that finds
    it still listed synchronises too instead of reading early."""
    for item in list(UNSETTLED):
        binding, kind = item
        if kind == "webgpu":
            with WEBGPU_LOCK:
                binding.synchronize_outputs()
        elif kind == "cuda":
            with CUDA_GATE.shared:  # a device sync must not happen while another thread captures
                binding.synchronize_outputs()
        else:
            binding.synchronize_outputs()
        try:
            UNSETTLED.remove(item)
        except ValueError:  # another thread settled it meanwhile
            pass


# -- os.fork() -----------------------------------------------------------------------------------------------------
# ORT's device EPs keep native state per process that a fork() child inherits without the threads that drive it.
# Measured (onnxruntime 1.32, WebGPU plugin EP 0.4.0, software Vulkan adapter), in a child forked after the parent
# made and ran a WebGPU session: the inherited session's first run hangs forever without a word; so does a WebGPU
# session the child makes itself (it is made, then its first run hangs); so does the inherited session's destruction
# (``del sess``, or the interpreter's exit; an ortcapture session with a captured graph: SIGSEGV). CUDA does not
# support fork either: a child cannot use the CUDA context its parent made. ORT's CPU EP survives (measured: an
# inherited CPU session, intra-op threads and all, runs in the child). So each device session records its :class:`Origin`; the at-fork hook marks, in the child, every origin
# made before the fork and keeps those sessions and their graphs alive for good (never destroyed: no device call),
# and :data:`FORKED_DEVICES` names the devices the parent had in use, which a session made in the child refuses too.


class Origin:
    """Where a device session was made: the process (``pid``), its execution providers other than the CPU EP
    (``eps``) and their device kinds (``kinds``: ``"cuda"``, ``"webgpu"``, or the EP's name for other EPs).

    ``forked`` turns True in an ``os.fork()`` child of that process (the at-fork hook at the end of this module), or
    is True from the start for a session made in a child on a device its parent had in use
    (``inherited`` False then). Every path of the session (and of its graphs and IOBindings) that reaches native code
    tests it first — one attribute read, behind a truth test of :data:`FORKED_DEVICES` that is all a process not
    forked from a device user pays — and calls :meth:`check`.
    """

    __slots__ = ("pid", "eps", "kinds", "forked", "inherited")

    def __init__(self, eps=(), kinds=(), *, inherited: bool = True) -> None:
        self.pid = os.getpid()
        self.eps = tuple(eps)
        self.kinds = tuple(kinds)
        self.forked = not inherited
        self.inherited = inherited

    def check(self, what: str = "") -> None:
        """Raise :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) when :attr:`forked`: the call would
        reach ORT's device state in a process that did not make it (ORT and Dawn would hang or crash there)."""
        if self.forked:
            raise self.error(what)

    def error(self, what: str = "") -> CaptureError:
        """The :class:`~ortcapture.errors.CaptureError` :meth:`check` raises (``kind`` ``"fork"``)."""
        eps = ", ".join(self.eps)
        head = f"{what}: " if what else ""
        if self.inherited:
            text = (f"{head}this InferenceSession ({eps}) was created in process {self.pid} before os.fork(); this is "
                    f"process {os.getpid()}, a child of it. ORT's CUDA/WebGPU device state does not survive fork (the "
                    "run would hang or crash without a word). Fork before the parent makes device sessions and make them "
                    "in the child, or use the 'spawn' (or 'forkserver') start method: "
                    "multiprocessing.set_start_method('spawn')")
        else:
            used = ", ".join(sorted(set(self.kinds) & FORKED_DEVICES))
            text = (f"{head}this InferenceSession ({eps}) was made in process {self.pid}, which os.fork() made from a "
                    f"process that had already used {used}: ORT's device state there is per process and does not "
                    "survive fork, so a session made in the child hangs on its first run too (measured: WebGPU). Use "
                    "the 'spawn' (or 'forkserver') start method, multiprocessing.set_start_method('spawn'), or fork "
                    "before the parent makes any device session")
        err = CaptureError(text)
        err.kind = "fork"
        return err


#: the origin of a session with no device EP (ORT's CPU EP survives fork): never marked
NO_DEVICE = Origin()
#: device kinds (see :class:`Origin`) an ancestor process had sessions on when ``os.fork()`` made this process;
#: empty unless this process is such a child. Filled in place by the at-fork hook (modules import it by name and
#: test it first: an empty set costs one truth test)
FORKED_DEVICES: set[str] = set()
_USED_DEVICES: set[str] = set()  # device kinds this process (or an ancestor before a fork) made sessions on
_HELD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # session or graph -> its Origin
_KEPT: list = []  # where keeping objects alive for good through a leaked reference is not possible


def device_origin(eps, kinds) -> Origin:
    """The :class:`Origin` of a C session just built in this process with execution providers ``eps`` (those other
    than the CPU EP) on device kinds ``kinds``: :data:`NO_DEVICE` without any; one already ``forked`` (its every use
    raises) when this process is an ``os.fork()`` child of one that had sessions on one of those devices."""
    if not kinds:
        return NO_DEVICE
    if FORKED_DEVICES.intersection(kinds):
        return Origin(eps, kinds, inherited=False)
    _USED_DEVICES.update(kinds)
    return Origin(eps, kinds)


def hold(obj, origin: Origin) -> None:
    """Mark ``origin`` forked in every ``os.fork()`` child while ``obj`` (a session or graph made with it) is alive
    here, and keep ``obj`` alive for good there: its destruction would reach the device (measured on WebGPU: a hang)."""
    if origin is NO_DEVICE or origin.forked:
        _HELD.pop(obj, None)
        return
    _HELD[obj] = origin


def origin_of(obj) -> Origin:
    """The :class:`Origin` :func:`hold` recorded for ``obj`` (a session), :data:`NO_DEVICE` when none."""
    try:
        return _HELD.get(obj, NO_DEVICE)
    except TypeError:  # unhashable or not weakly referenceable: not a session ortcapture made
        return NO_DEVICE


def check_device(kind: str, what: str = "") -> None:
    """Raise :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) when device kind ``kind`` (an OrtValue's:
    ``"cuda"``, ``"webgpu"``) is in :data:`FORKED_DEVICES`: its buffers belong to the parent's device state, which
    does not survive fork (a copy would hang or crash)."""
    if kind in FORKED_DEVICES:
        where = f" ({what})" if what else ""
        err = CaptureError(
            f"a transfer of a {kind} buffer{where} in process {os.getpid()}, which os.fork() made from a process that "
            f"had already used {kind}: ORT's {kind} device state does not survive fork, so the copy would hang or "
            "crash without a word. Use the 'spawn' (or 'forkserver') start method: "
            "multiprocessing.set_start_method('spawn')")
        err.kind = "fork"
        raise err


def _keep_forever(objs: list) -> None:
    """Never free ``objs`` (nor what they hold): one reference that is never given back, so neither ``del`` nor the
    interpreter's exit destroys them (a module-level list would be cleared at exit)."""
    try:
        import ctypes

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(objs))
    except Exception:  # noqa: BLE001 - no ctypes: kept until the interpreter's exit at least
        _KEPT.append(objs)


# ---------------------------------------------------------------------------------------------------------------
# settings: the ORTCAPTURE_* environment variables ortcapture reads, each once, at import (docs/INSTALL.md lists
# them). The modules that use them read them here, at call time: set them here (tests do).
# ---------------------------------------------------------------------------------------------------------------
#: Force a device-to-device backend: None (auto), "ort" (OrtValue.update_inplace) or "cuda-python" (cudaMemcpyAsync).
#: Set from $ORTCAPTURE_COPY_BACKEND at import; tests set it here.
COPY_BACKEND = os.environ.get("ORTCAPTURE_COPY_BACKEND") or None

#: $ORTCAPTURE_COMPUTE_STREAM=0: leave the CUDA EP's stream to ORT (feed copies then wait, as ORT's own do)
COMPUTE_STREAM = os.environ.get("ORTCAPTURE_COMPUTE_STREAM", "1") != "0"


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one: a container's cpuset, ``taskset``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: Host memcpy threads of a pinned staging fill (a big numpy feed is copied into the page-locked buffer in chunks,
#: each thread claiming the next chunk and queuing its host-to-device copy as soon as it is in; the calling thread is
#: one of them): $ORTCAPTURE_STAGING_THREADS, default 3 where the process may use 3 CPUs (1: the calling
#: thread alone). On the H200 (9.8 MB YOLOv8n b8 input, ``benchmarks/bench_host_copy.py``, 1 MiB chunks) fill and
#: upload together took 518-627 / 535-588 / 554-607 µs at 2 / 3 / 4 threads from a source in cache, and 705-753 /
#: 598-622 / 617-681 µs from a new array each call (8 in turn, not in cache: the case plain numpy serving has); at 8
#: threads 1126 µs: the host copies and the DMA contend for memory bandwidth. numpy releases the GIL for the copies;
#: ``benchmarks/profile_replay.py`` times them.
STAGING_THREADS = int(os.environ.get("ORTCAPTURE_STAGING_THREADS") or 0) or min(3, _usable_cpus())

#: Chunk of a pipelined fill (bytes; $ORTCAPTURE_STAGING_CHUNK); feeds up to twice this go in one piece
STAGING_CHUNK = int(os.environ.get("ORTCAPTURE_STAGING_CHUNK") or 0) or 1 << 20

#: $ORTCAPTURE_STAGING_PIN=1: each staging worker thread runs on one CPU of its own (spread over the process's
#: affinity mask) instead of wherever the scheduler wakes it. Off by default; the profile measures both. A burst of
#: copies shorter than the scheduler's load balancing can otherwise land a woken worker on its waker's busy CPU.
STAGING_PIN = os.environ.get("ORTCAPTURE_STAGING_PIN", "0") == "1"


#: $ORTCAPTURE_PINNED=0 turns page-locked staging off (graphs then stage in ordinary host memory, as on WebGPU)
PINNED = os.environ.get("ORTCAPTURE_PINNED", "1") != "0"

def _auto_min(value: str | None) -> int | None:
    """$ORTCAPTURE_PINNED_MIN: bytes; ``off`` (or ``none``): never unasked; unset: :data:`PINNED_AUTO_DEFAULT`."""
    if value is None or not value.strip():
        return PINNED_AUTO_DEFAULT
    if value.strip().lower() in ("off", "none"):
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"ORTCAPTURE_PINNED_MIN must be a number of bytes or 'off', got {value!r}") from None


#: Unasked staging's default threshold: graphs whose inputs and outputs hold at least 1 MiB
PINNED_AUTO_DEFAULT = 1 << 20

#: A graph whose inputs and outputs hold at least this many bytes stages plain numpy feeds and
#: ``copy_outputs=True`` outputs through page-locked memory unasked ($ORTCAPTURE_PINNED_MIN; ``off``: only once a
#: graph's host buffers are asked for: ``host_inputs``, ``copy_outputs="pinned"``, ``out=``, ``run_many``). Below it
#: (small models) ORT's own pageable path is kept: its copies are too small for the staging to pay off.
PINNED_AUTO_MIN = _auto_min(os.environ.get("ORTCAPTURE_PINNED_MIN"))


#: Page-locked bytes an :class:`ortcapture._transfer.staging._OutputPool` may hold beyond two sets of outputs
#: ($ORTCAPTURE_PINNED_POOL_BYTES)
OUTPUT_POOL_BYTES = int(os.environ.get("ORTCAPTURE_PINNED_POOL_BYTES") or 64 << 20)

#: $ORTCAPTURE_REGISTER=0 turns off page-locking repeated numpy feeds in place (:class:`ortcapture._transfer.
#: staging._InPlace`) and feeding from memory its owner page-locked (:data:`HOST_RANGES`)
REGISTER = os.environ.get("ORTCAPTURE_REGISTER", "1").strip().lower() not in ("0", "off", "false", "no")

#: Bytes of callers' arrays one graph keeps page-locked (and alive) at most ($ORTCAPTURE_REGISTER_BYTES)
REGISTER_BYTES = int(os.environ.get("ORTCAPTURE_REGISTER_BYTES") or 256 << 20)

#: host memory page-locked by its owner (:func:`ortcapture.transfer.pin_host_memory`): ``(start, end)`` addresses,
#: the list replaced whole on each change (readers take no lock); a synchronous feed inside one goes by one DMA
HOST_RANGES: list[tuple[int, int]] = []


def owner_pinned(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies inside one range of :data:`HOST_RANGES`."""
    return any(a <= ptr and ptr + nbytes <= b for a, b in HOST_RANGES)


# ---------------------------------------------------------------------------------------------------------------
# the staging copy threads: process-wide thread pools (ortcapture._transfer.host_copy copies on them)
# ---------------------------------------------------------------------------------------------------------------
_POOL: list = []
_POOL_LOCK = threading.Lock()


def _pinning_initializer(threads: int):
    """A ThreadPoolExecutor initializer putting worker i (1 .. threads-1) on CPU ``cpus[i * len(cpus) // threads]``
    of the process's affinity mask at the time (nothing where the OS has no affinity call or refuses it)."""
    import itertools

    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    counter = itertools.count(1)

    def init() -> None:
        i = next(counter)
        try:
            os.sched_setaffinity(0, {cpus[(i * len(cpus) // threads) % len(cpus)]})
        except OSError:
            pass
    return init


def staging_pool(threads: int | None = None, pin: bool | None = None):
    """The process's staging copy threads (``None`` with :data:`STAGING_THREADS` 1); ``threads``/``pin``: a pool of
    that many (pinned or not: :data:`STAGING_PIN`) instead (the profile's scaling runs), made once per choice. The
    pool holds ``threads - 1`` workers: the calling thread copies a share itself."""
    threads = STAGING_THREADS if threads is None else int(threads)
    pin = STAGING_PIN if pin is None else bool(pin)
    if threads <= 1:
        return None
    key = (threads, pin)
    for k, pool in _POOL:
        if k == key:
            return pool
    from concurrent.futures import ThreadPoolExecutor

    with _POOL_LOCK:
        for k, pool in _POOL:
            if k == key:
                return pool
        pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="ortcapture-staging",
                                  initializer=_pinning_initializer(threads) if pin else None)
        _POOL.append((key, pool))
    return pool


# ---------------------------------------------------------------------------------------------------------------
# the at-fork hook: the one os.register_at_fork of ortcapture (the fork notes above)
# ---------------------------------------------------------------------------------------------------------------
def _after_fork_in_child() -> None:
    """The at-fork hook (in the child): the parent's devices are inherited; every session and graph held
    (:func:`hold`) is marked and kept alive for good; runs the parent left unsettled are dropped unsettled (their
    synchronisation would reach the device); host memory the parent page-locked is not the child's."""
    global HOST_RANGES
    HOST_RANGES = []
    FORKED_DEVICES.update(_USED_DEVICES)
    if FORKED_DEVICES:
        # Garbage the parent had not collected yet (sessions, graphs, buffers of released graphs in reference
        # cycles) must not be destroyed here: that reaches the parent's device state (measured on WebGPU: the child
        # hung in gc.collect() after a batch runner's sessions). gc.freeze() moves every object alive at the fork to
        # the permanent generation, which the child's collections never look at.
        import gc

        gc.freeze()
    kept = []
    for obj, origin in list(_HELD.items()):
        origin.forked = True
        kept.append(obj)
    kept.extend(binding for binding, _ in UNSETTLED)
    UNSETTLED.clear()
    if kept:
        _keep_forever(kept)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)
