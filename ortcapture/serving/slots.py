"""Batch slots: node-local shared memory for the hop from a batching-tier replica to a session replica (no Ray).

Through Ray, a batch's joined inputs (YOLOv8n at 320: 1.2 MB a row) and its outputs (0.7 MB a row) each become an
object in Ray's object store: a copy in, and the object's creation, sealing, pinning and release, RPCs to the raylet
on every call. Measured on a 2-core machine (Ray 2.60, one actor call, 1.2 MB in and 0.7 MB out): 4.1 ms against
1.3 ms with small arguments. A tier replica and a session replica on one machine can instead share memory:

* :class:`SlotPool` (the tier) creates one POSIX shared memory object (``/dev/shm/<name>``, mode 0600, the name
  carrying 128 random bits) of ``count`` slots; each slot holds one batch's inputs and then its outputs. The tier
  joins a batch's rows straight into a slot (:meth:`Slot.place`), sends the session replica a small
  descriptor (:meth:`Slot.descriptor`) instead of the arrays, and reads the
  outputs back from the slot (:meth:`Slot.outputs`) once the session replica answered; the slot is reused only
  after that answer (a batch in flight owns its slot).
* :class:`SlotReader` (the session replica) maps a pool by name once and reads a descriptor's inputs as numpy
  views (no copy) and writes the outputs into the slot (:meth:`SlotReader.write_outputs`). A session replica on
  another machine finds no object of that name (:class:`SlotMissing`): the tier sends that batch by value, as
  before.

Every offset and size in a descriptor is checked against the mapped object before a view is made; outputs larger
than the slot's room go back by value. Neither side ever unmaps memory a view may still use: a pool is unlinked by
its tier (:meth:`SlotPool.close`) and unmapped by the session replica only when it closes.
"""
from __future__ import annotations

import asyncio
import os
import re
import secrets
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture.serving.requests import join_into
from ortcapture.transfer import host_copy

#: byte alignment of every array in a slot (page-locking and DMA prefer it)
ALIGN = 4096
#: where POSIX shared memory objects live
SHM_DIR = "/dev/shm"
#: seconds between :meth:`SlotReader.drop_stale` runs when no new pool asks for one
DROP_EVERY_S = 10.0


def _gone_is_missing(shm, fn, *args):
    """``fn(*args)`` with ``shm``'s memoryview among ``args``: where :meth:`SlotReader.drop_stale` closed ``shm``
    meanwhile (its memoryview released: ``ValueError``/``TypeError``), :class:`SlotMissing` (the batch goes by
    value)."""
    try:
        return fn(*args)
    except (ValueError, TypeError):
        if shm.buf is None:
            raise SlotMissing(f"shared memory object {shm.name!r} was unmapped here meanwhile") from None
        raise


def slot_dtype(dtype) -> bool:
    """Whether arrays of ``dtype`` can travel in a slot: its descriptor string names it again (``ml_dtypes``'
    bfloat16 reads back as raw ``|V2`` bytes, so such arrays go by value)."""
    dt = np.dtype(dtype)
    return np.dtype(dt.str) == dt and dt.kind not in "OV"


class SlotMissing(LookupError):
    """The descriptor's shared memory object is not on this machine (or is not the pool it names)."""


def _up(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def _view(buf, off: int, shape, dtype) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` at byte ``off`` of ``buf`` (a mapping's memoryview) that holds an export
    of the mapping: closing the mapping while it lives raises ``BufferError``. (``np.ndarray(buffer=buf)`` holds
    none: ``SharedMemory.close()`` then unmaps the memory under the array, and reading it is a segfault.)"""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    return np.frombuffer(buf[off:off + n], dt).reshape(tuple(shape))


class Slot:
    """One slot of a :class:`SlotPool`: ``[offset, offset + in_bytes)`` for the inputs, then ``out_bytes`` for the
    outputs."""

    def __init__(self, pool: "SlotPool", index: int):
        self.pool = pool
        self.index = index
        self.offset = index * (pool.in_bytes + pool.out_bytes)
        self._placed: list[list[tuple[str, int, tuple[int, ...], str]]] = []

    def place(self, runs: Sequence[tuple[Sequence[tuple[str, Sequence[np.ndarray], int]]]]) -> bool:
        """Join each run's pieces into this slot: ``runs`` is, per run, ``[(input name, [pieces], axis)]`` (an axis
        of ``None``: one array used as it is). Returns ``False`` (nothing placed) when they do not fit."""
        need, plan = 0, []
        if not all(slot_dtype(p[0].dtype) for run in runs for _, p, _ in run):
            return False
        for run in runs:
            entries = []
            for name, pieces, axis in run:
                first = pieces[0]
                shape = list(first.shape)
                if axis is not None and len(pieces) > 1:
                    shape[axis] = sum(int(p.shape[axis]) for p in pieces)
                nbytes = int(np.prod(shape, dtype=np.int64)) * first.dtype.itemsize
                entries.append((name, pieces, axis, tuple(shape), first.dtype, need))
                need += _up(nbytes)
            plan.append(entries)
        if need > self.pool.in_bytes:
            return False
        self._placed = []
        buf = self.pool.buf
        for entries in plan:
            placed = []
            for name, pieces, axis, shape, dtype, off in entries:
                view = _view(buf, self.offset + off, shape, dtype)
                # big copies split over the staging threads: the tier's event loop, which bounds a tier replica
                if axis is None or len(pieces) == 1:
                    host_copy(pieces[0], view)
                else:
                    join_into(pieces, axis, view)
                placed.append((name, self.offset + off, shape, dtype.str))
            self._placed.append(placed)
        return True

    def descriptor(self) -> dict:
        """What the session replica needs to find this slot's inputs and its output room: the pool's name and size,
        per run its inputs ``[(name, offset, shape, dtype)]``, and the output room ``(offset, bytes)``."""
        return {"pool": self.pool.name, "size": self.pool.size, "runs": self._placed,
                "out": (self.offset + self.pool.in_bytes, self.pool.out_bytes)}

    def outputs(self, where: Mapping[str, tuple[int, Sequence[int], str]]) -> dict[str, np.ndarray]:
        """Views of a run's outputs as :meth:`SlotReader.write_outputs` placed them (valid until this slot is
        released: copy what outlives it)."""
        lo, hi = self.offset + self.pool.in_bytes, self.offset + self.pool.in_bytes + self.pool.out_bytes
        out = {}
        for name, (off, shape, dtype) in where.items():
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
            if not (lo <= int(off) and int(off) + n <= hi):
                raise ValueError(f"slot output {name!r} at {off} (+{n} bytes) is outside the slot's output room")
            out[name] = _view(self.pool.buf, int(off), shape, dt)
        return out


class SlotPool:
    """``count`` slots of ``in_bytes`` + ``out_bytes`` (each rounded up to 4 KiB) in one new shared memory object
    (see the module docstring). Used from one event loop: :meth:`acquire` waits for a free slot."""

    def __init__(self, in_bytes: int, out_bytes: int, count: int, prefix: str = "ortcapture"):
        if count < 1 or in_bytes < 1 or out_bytes < 1:
            raise ValueError(f"SlotPool: count {count}, in_bytes {in_bytes} and out_bytes {out_bytes} must be >= 1")
        self.in_bytes, self.out_bytes, self.count = _up(in_bytes), _up(out_bytes), int(count)
        self.size = self.count * (self.in_bytes + self.out_bytes)
        sweep_stale_pools(prefix)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(16)}"
        if os.path.isdir(SHM_DIR) and hasattr(os, "posix_fallocate"):
            # created and its pages reserved here: a tmpfs without room for them refuses now (ENOSPC, OSError)
            # instead of a SIGBUS at the first write past its room (shared_memory's own create= only sets the size)
            path = os.path.join(SHM_DIR, name)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
            os.close(fd)
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=False)  # mapped, tracked (unlinked at exit)
            except BaseException:
                os.unlink(path)
                raise
        else:  # no /dev/shm (macOS): the standard library's own object
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=self.size)
        self.name = self._shm.name
        self.buf = self._shm.buf
        self._free: asyncio.Queue | None = None
        self.slots = [Slot(self, i) for i in range(self.count)]
        self.retired = 0

    async def acquire(self) -> Slot | None:
        """A free slot (waits while every slot has a batch in flight); ``None`` for a slot :meth:`retire` d: that
        batch goes by value."""
        if self._free is None:
            self._free = asyncio.Queue()
            for s in self.slots:
                self._free.put_nowait(s)
        slot = await self._free.get()
        if slot is None:  # a retired slot's turn: stays in the rotation as "by value"
            self._free.put_nowait(None)
        return slot

    def release(self, slot: Slot) -> None:
        """Give ``slot`` back — only once the session replica answered for its batch: until then it may still read
        that batch's outputs into the slot (:meth:`SlotReader.output_arena`); a batch whose outcome is unknown
        :meth:`retire` s its slot instead."""
        self._free.put_nowait(slot)

    def retire(self, slot: Slot) -> None:
        """Never use ``slot`` again: its batch's outcome is unknown (the call failed or was cancelled), so the
        session replica may still write into it. Its turn goes by value from now on."""
        self.retired += 1
        self._free.put_nowait(None)

    def close(self) -> None:
        """Unlink the object (the session replicas keep their mappings until they close)."""
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass


_POOL_NAME = re.compile(r"-(\d+)-[0-9a-f]{32}$")


def sweep_stale_pools(prefix: str = "ortcapture") -> list[str]:
    """Unlink the pools in ``/dev/shm`` whose creating process is gone: ``<prefix>-<pid>-<32 hex>`` objects of this
    user whose pid no longer runs on this machine (a tier replica killed with SIGKILL cannot unlink its own; a live
    process's pool, another user's or another name is never touched; a session replica that still maps a swept pool
    keeps its mapping). Called whenever a pool is made. Returns the names unlinked."""
    if not os.path.isdir(SHM_DIR):
        return []
    gone = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    for name in names:
        m = _POOL_NAME.search(name)
        if m is None or not name.startswith(prefix + "-") or len(name) != len(prefix) + len(m.group(0)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _alive(int(m.group(1))):
                continue
            os.unlink(path)
            gone.append(name)
        except OSError:  # gone already, or not ours to remove
            continue
    return gone


def pool_owners(created_after: float, prefix: str = "ortcapture") -> list[int]:
    """The live processes that made a pool in ``/dev/shm`` (``<prefix>-<pid>-<32 hex>``) at or after
    ``created_after`` (``time.time()``; the pool's change time): a server's own tier replicas, what its stop waits
    for before :func:`sweep_stale_pools` can unlink their pools (a pool of a server started before it is not)."""
    try:
        names = os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []
    except OSError:
        return []
    out = []
    for name in names:
        m = _POOL_NAME.search(name)
        if m is None or not name.startswith(prefix + "-") or len(name) != len(prefix) + len(m.group(0)):
            continue  # not a pool of this prefix (another prefix that starts with it: ortcapture-registry-...)
        try:
            if os.lstat(os.path.join(SHM_DIR, name)).st_ctime >= created_after and _alive(int(m.group(1))):
                out.append(int(m.group(1)))
        except OSError:  # gone already
            continue
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped: a replica whose raylet died, until PID 1 reaps it)
    does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):  # no /proc (macOS), or gone meanwhile
        return True


class SlotReader:
    """The session replica's side: pools mapped by name (once each), descriptors read and checked.

    ``pin``: page-lock each pool once mapped (:func:`ortcapture.transfer.pin_host_memory`; a CUDA session replica),
    so a batch's rows go from the slot to the graph's input buffer with one DMA, no host copy into the graph's
    staging. A pool the driver will not lock is read as before (``pin_error`` says why)."""

    def __init__(self, pin: bool = False):
        self._maps: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()  # _maps and _pins: mapped on the event loop, dropped on the replay thread
        #: a pool was mapped since the last :meth:`drop_stale` (only then can another tier replica have gone)
        self.new_pools = False
        #: pools unmapped by :meth:`drop_stale`
        self.dropped = 0
        self._next_drop = time.monotonic() + DROP_EVERY_S
        self._pin = pin
        self._pins: dict[str, Any] = {}  # pool name -> PinnedHostMemory
        #: why the last pool could not be page-locked (``None``: every pool mapped is, or ``pin`` is off)
        self.pin_error: str | None = None
        #: outputs :meth:`write_outputs` found read into their place already (:meth:`output_arena`): not copied
        self.in_place = 0

    def _pool(self, name: str, size: int) -> tuple[shared_memory.SharedMemory, memoryview]:
        """The pool ``name`` mapped (once) and its memoryview, read once: :meth:`drop_stale` on another thread may
        close it meanwhile (then using the memoryview raises, :func:`_gone_is_missing`)."""
        shm = self._maps.get(name)
        if shm is None:
            with self._lock:
                shm = self._map(name)
        buf = shm.buf
        if buf is None:  # being dropped (drop_stale: unmapped once its last view goes)
            raise SlotMissing(f"shared memory object {name!r} is being unmapped here")
        if shm.size < int(size):
            raise SlotMissing(f"shared memory object {name!r} is {shm.size} bytes, the descriptor says {size}")
        return shm, buf

    def _map(self, name: str) -> shared_memory.SharedMemory:
        shm = self._maps.get(name)
        if shm is None:
            if not isinstance(name, str) or "/" in name or not name.startswith("ortcapture"):
                raise SlotMissing(f"not a slot pool name: {name!r}")
            try:
                shm = shared_memory.SharedMemory(name=name, create=False)
            except FileNotFoundError:
                raise SlotMissing(f"no shared memory object {name!r} on this machine") from None
            if not name.startswith(f"ortcapture-{os.getpid()}-"):  # not this process's own pool
                try:  # attached, not created here: Python < 3.13 registers it anyway and would unlink it at exit
                    resource_tracker.unregister("/" + name, "shared_memory")
                except Exception:  # noqa: BLE001 - a Python that does not register attached objects
                    pass
            self._maps[name] = shm
            if self._pin:
                from ortcapture.transfer import pin_host_memory

                try:
                    self._pins[name] = pin_host_memory(shm.buf)
                except Exception as exc:  # noqa: BLE001 - no cuda-python, the driver refused: read as before
                    self.pin_error = f"{type(exc).__name__}: {exc}"[:300]
            self.new_pools = True
        return shm

    def drop_due(self) -> bool:
        """Whether :meth:`drop_stale` should run now: a pool was mapped since it last ran, a pool it had to keep is
        waiting, or :data:`DROP_EVERY_S` passed (a tier replica can go with no new pool after it: a scale-down)."""
        return self.new_pools or time.monotonic() >= self._next_drop

    def drop_stale(self) -> list[str]:
        """Undo the page-locking of, and unmap, every pool whose tier replica is gone (its process, named in the
        pool's name, no longer runs on this machine: a replica Ray restarted, killed or scaled down; and its object
        unlinked, by that replica or by :func:`sweep_stale_pools` when the next pool was made), so a long-lived
        session replica does not keep each gone tier's pool (YOLOv8n at 320, 4 slots of 8 rows: ~60 MB) page-locked
        and mapped for good. Call it where no run reads from a pool (the session replica's replay thread, between
        runs: :meth:`drop_due`): a batch of that pool still queued then goes through the staging's host copy. A
        pool a view still uses stays mapped, unpinned, and is tried again next time (a batch of it arriving
        meanwhile goes by value: :class:`SlotMissing`), as is one whose unpinning failed. Never raises. Returns the
        names unmapped."""
        gone, again = [], False
        with self._lock:
            self.new_pools = False
            self._next_drop = time.monotonic() + DROP_EVERY_S
            for name in list(self._maps):
                m = _POOL_NAME.search(name)
                if m is None or m.group(1) == str(os.getpid()):
                    continue
                if _alive(int(m.group(1))) or os.path.exists(os.path.join(SHM_DIR, name)):
                    continue  # its tier replica runs, or its pool is not unlinked yet (sweep_stale_pools does that)
                try:
                    pin = self._pins.get(name)
                    if pin is not None:
                        pin.close()
                        del self._pins[name]
                    self._maps[name].close()
                except BufferError:  # a view is alive (a batch still queued): unmapped next time
                    again = True
                    continue
                except Exception as exc:  # noqa: BLE001 - a driver error unpinning it: kept, tried again
                    self.pin_error = f"dropping {name}: {type(exc).__name__}: {exc}"[:300]
                    again = True
                    continue
                del self._maps[name]
                gone.append(name)
            self.dropped += len(gone)
            self.new_pools = again
        return gone

    def inputs(self, desc: Mapping[str, Any]) -> list[dict[str, np.ndarray]]:
        """Per run, ``{input name: numpy view}`` (no copy). Raises :class:`SlotMissing` (send by value) or
        ``ValueError`` (a descriptor that does not fit its pool)."""
        shm, buf = self._pool(desc["pool"], desc["size"])
        out = []
        for run in desc["runs"]:
            feeds = {}
            for name, off, shape, dtype in run:
                dt = np.dtype(dtype)
                n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                if int(off) < 0 or int(off) + n > shm.size:
                    raise ValueError(f"slot input {name!r} at {off} (+{n} bytes) is outside its pool")
                feeds[name] = _gone_is_missing(shm, _view, buf, int(off), shape, dt)
            out.append(feeds)
        return out

    def write_outputs(self, desc: Mapping[str, Any], runs_outputs: Sequence[Mapping[str, np.ndarray]]
                      ) -> list[dict[str, tuple[int, tuple[int, ...], str]]] | None:
        """Write every run's outputs into the descriptor's output room; per run ``{name: (offset, shape, dtype)}``,
        or ``None`` when they do not fit (send them by value)."""
        shm, buf = self._pool(desc["pool"], desc["size"])
        base, room = int(desc["out"][0]), int(desc["out"][1])
        if base < 0 or base + room > shm.size:
            raise ValueError("the descriptor's output room is outside its pool")
        need = sum(_up(np.asarray(o).nbytes) for outs in runs_outputs for o in outs.values())
        if need > room or not all(slot_dtype(np.asarray(o).dtype) for outs in runs_outputs for o in outs.values()):
            return None
        room_view = _gone_is_missing(shm, _view, buf, base, (room,), np.uint8)
        off, plan = base, []
        for outs in runs_outputs:
            for name, o in outs.items():
                o = np.asarray(o)
                dst = _view(buf, off, o.shape, o.dtype)
                if o.ctypes.data == dst.ctypes.data and o.flags.c_contiguous:
                    o = None  # read there already (ortcapture.transfer.outputs_into): no copy
                elif np.may_share_memory(o, room_view):
                    o = o.copy()  # elsewhere in the room: an earlier output's copy could overwrite it
                plan.append((dst, o))
                off += _up(dst.nbytes)
        for dst, o in plan:
            if o is None:
                self.in_place += 1
            else:
                np.copyto(dst, o)
        off, placed = base, []
        for outs in runs_outputs:
            where = {}
            for name, o in outs.items():
                o = np.asarray(o)
                where[name] = (off, tuple(o.shape), o.dtype.str)
                off += _up(o.nbytes)
            placed.append(where)
        return placed

    def output_arena(self, desc: Mapping[str, Any], start: int | None = None):
        """The descriptor's output room from ``start`` (bytes from the pool's start; ``None``: the room's start) as
        an :class:`ortcapture.transfer.OutputArena` laid out as :meth:`write_outputs` lays out outputs: read inside
        ``ortcapture.transfer.outputs_into(arena)``, outputs land where :meth:`write_outputs` would copy them, which
        then skips the copy (counted in :attr:`in_place`). ``None`` when the pool is not page-locked (a DMA into
        pageable memory gains nothing) or the room is outside the pool. Raises :class:`SlotMissing`."""
        from ortcapture.transfer import OutputArena

        shm, buf = self._pool(desc["pool"], desc["size"])
        if desc["pool"] not in self._pins:
            return None
        base, room = int(desc["out"][0]), int(desc["out"][1])
        start = base if start is None else int(start)
        if base < 0 or base + room > shm.size or not base <= start <= base + room:
            return None
        return _gone_is_missing(shm, OutputArena, buf, start, base + room, ALIGN)

    @property
    def pinned(self) -> int:
        """Pools page-locked now."""
        return len(self._pins)

    def in_pinned_pool(self, a: np.ndarray) -> bool:
        """Whether all of host array ``a``'s bytes lie in a pool page-locked here (a slot's rows: a DMA reads them
        straight from there)."""
        start = a.__array_interface__["data"][0]
        end = start + a.nbytes
        with self._lock:
            pins = list(self._pins.values())
        for pin in pins:
            if not pin.closed and pin.ptr <= start and end <= pin.ptr + pin.nbytes:
                return True
        return False

    def close(self) -> None:
        """Undo the page-locking and unmap every pool (only when no view of them is left; call it when no run reads
        from them)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for name, pin in list(self._pins.items()):
            try:
                pin.close()
            except Exception as exc:  # noqa: BLE001 - kept (and its mapping): the others are still closed
                self.pin_error = f"closing {name}: {type(exc).__name__}: {exc}"[:300]
                continue
            del self._pins[name]
        for name, shm in list(self._maps.items()):
            if name in self._pins:  # still page-locked: never unmapped under the driver's registration
                continue
            try:
                shm.close()
            except BufferError:  # a view is still alive: kept for a later close (its descriptor too)
                continue
            del self._maps[name]


def batch_slots(spec, max_rows: int, count: int, enabled: bool) -> SlotPool | None:
    """The tier replica's :class:`~ortcapture.serving.slots.SlotPool`: ``count`` slots, each for ``max_rows`` rows
    of every input and output of ``spec`` (an output with a dim the model leaves open gets as much room as the
    inputs, at least 16 MiB: outputs that do not fit go back by value); ``None`` when ``enabled`` is false or
    ``/dev/shm`` refuses the object (by value through Ray, as on another machine)."""
    if not enabled:
        return None

    def nbytes(t) -> int | None:
        dims = [max_rows if (ax == 0 and d == -1) else d for ax, d in enumerate(t.shape)]
        return None if any(d < 0 for d in dims) else int(np.prod(dims, dtype=np.int64)) * np.dtype(t.dtype).itemsize

    ins = [nbytes(t) for t in spec.inputs]
    if any(n is None for n in ins):
        return None
    outs = [nbytes(t) for t in spec.outputs]
    in_bytes = sum(ins)
    out_bytes = sum(outs) if all(n is not None for n in outs) else max(in_bytes, 16 << 20)
    try:
        return SlotPool(in_bytes + 4096 * len(ins), out_bytes + 4096 * len(outs), count)
    except OSError:  # no /dev/shm room: by value
        return None
