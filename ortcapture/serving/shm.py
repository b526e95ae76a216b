"""Triton's system shared memory extension: the region registry, mapped regions, every bound check (no Ray).

A client puts a tensor in a POSIX shared memory object (``tritonclient.utils.shared_memory``: ``shm_open(key)``,
``/dev/shm/<key>``), registers a *region* of it under a server-wide ``name`` (``key``, ``offset``, ``byte_size``) and
names that region in an input's or a requested output's parameters (``shared_memory_region``,
``shared_memory_offset``, ``shared_memory_byte_size``) instead of sending the bytes.

* :class:`Regions` is the registry itself: names to :class:`Region` s, a taken name refused, a generation per
  registration (so a process that mapped a region knows when its name now means another one). It holds no memory.
* :class:`Maps` maps the regions a process reads or writes (lazily, once per generation; one file descriptor kept
  per region, its size checked again before every access: a client that shrinks its object after registering gets a
  400, never a SIGBUS in the server).
* :func:`reference` checks one tensor's reference against its region (known name, integer offset and size, inside
  the region) **before** anything is read or written; every refusal is a :class:`ShmError` (a 400) naming the
  parameter.
* :func:`check_key` keeps a key to one name under ``/dev/shm`` (no ``/`` inside it, no ``..``, no symbolic link).

Registration is for clients on the server's machine: :func:`is_loopback` says whether a peer address is one.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass, replace
from typing import Any, Mapping
from urllib.parse import unquote

from ortcapture.serving.protocol import ProtocolError

#: where POSIX shared memory objects live (``shm_open(key)`` is ``/dev/shm/<key without its leading slash>``)
SHM_DIR = "/dev/shm"
#: names of the server's own shared memory objects (the batch slots): never a client's region
SERVER_PREFIX = "ortcapture-"
#: the parameters that name a region for one tensor
REGION, OFFSET, BYTE_SIZE = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
PARAMETERS = (REGION, OFFSET, BYTE_SIZE)


class ShmError(ProtocolError):
    """A shared memory request the server refuses: a 400 (``INVALID_ARGUMENT`` over gRPC), the message names the
    region and the parameter."""


@dataclass(frozen=True)
class Region:
    """One registered region: ``byte_size`` bytes of shared memory object ``key`` from ``offset``; ``generation``
    tells two registrations of one name apart — of one registry, or of two (:class:`Regions`)."""

    name: str
    key: str
    offset: int
    byte_size: int
    generation: int = 0
    #: a CUDA region (:mod:`ortcapture.serving.cuda_shm`): the CUDA IPC handle (64 bytes) and the client's device
    raw_handle: bytes = b""
    device_id: int = -1

    @property
    def kind(self) -> str:
        """``"cuda"`` (a CUDA IPC handle, Triton's CUDA shared memory extension) or ``"system"``."""
        return "cuda" if self.raw_handle else "system"

    def status(self) -> dict:
        """Triton's status entry of the region: ``name``, ``key``, ``offset``, ``byte_size`` (CUDA: ``name``,
        ``device_id``, ``byte_size``)."""
        if self.raw_handle:
            return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ShmError(f"{what} must be an integer >= 0, got {value!r}"[:200])
    return value


def check_key(key) -> str:
    """``key`` if it names one shared memory object (``/name`` or ``name``: one path component, not ``.``/``..``,
    no NUL); raises :class:`ShmError` otherwise (a key with ``/`` inside would name any file)."""
    if not isinstance(key, str):
        raise ShmError(f"shared memory key must be a string, got {key!r}"[:200])
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or "\0" in name or name in (".", "..") or len(name) > 255:
        raise ShmError(f"shared memory key {key[:100]!r} is not the name of a shared memory object "
                       "(one name, as shm_open takes it: '/name')")
    if name.startswith(SERVER_PREFIX):  # the server's own batch slots (ortcapture.serving.slots): other batches
        raise ShmError(f"shared memory key {key[:100]!r} names the server's own memory (keys starting with "
                       f"{SERVER_PREFIX!r} are refused): use a key of your own")
    return name


def object_size(key: str) -> int:
    """The size in bytes of shared memory object ``key``; :class:`ShmError` when it does not exist or is not a
    regular file (a symbolic link is not followed)."""
    path = os.path.join(SHM_DIR, check_key(key))
    try:  # O_NONBLOCK: a FIFO put there opens at once (and is refused below) instead of blocking the event loop
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ShmError(f"shared memory key {key[:100]!r}: cannot open it ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ShmError(f"shared memory key {key[:100]!r} is not a shared memory object")
    return st.st_size


class Regions:
    """The server-wide registry: names to :class:`Region` s. It checks what a registration says (name, key, integer
    offset and size); the object's own size is checked by the process that maps it (:func:`check_object`)."""

    def __init__(self):
        self._regions: dict[str, Region] = {}
        # generations count up from a random 62-bit start, not from 0: a registry made again after its actor died
        # (shm_store.ActorRegistry) must never hand out a (name, generation) that an ingress replica's Maps or a
        # session replica's CUDA handles (cuda_ipc) still hold open for the old registry's region of that name —
        # they would read, and write outputs into, the old object or allocation
        self._generation = secrets.randbits(62)

    def register(self, name, key, offset, byte_size) -> Region:
        """Register region ``name``. Raises :class:`ShmError`: an empty or non-string name, a name registered
        already (unregister it first; system and CUDA regions share the names, as in Triton), a bad key, an offset
        or size that is not an integer >= 0, a size of 0."""
        self._free_name(name)
        check_key(key)
        offset = _int(offset, f"region {name!r}: offset")
        size = _int(byte_size, f"region {name!r}: byte_size")
        if size == 0:
            raise ShmError(f"region {name!r}: byte_size must be at least 1")
        return self._add(Region(name, key, offset, size))

    def register_cuda(self, name, raw_handle: bytes, device_id, byte_size) -> Region:
        """Register CUDA region ``name``: ``byte_size`` bytes of the allocation ``raw_handle`` (a CUDA IPC handle,
        checked by :func:`ortcapture.serving.cuda_shm.check_register`) names on the client's ``device_id``.
        Raises :class:`ShmError` as :meth:`register` does."""
        self._free_name(name)
        if not isinstance(raw_handle, bytes) or not raw_handle:
            raise ShmError(f"region {name!r}: raw_handle must be the CUDA IPC handle's bytes")
        device = _int(device_id, f"region {name!r}: device_id")
        size = _int(byte_size, f"region {name!r}: byte_size")
        if size == 0:
            raise ShmError(f"region {name!r}: byte_size must be at least 1")
        return self._add(Region(name, "", 0, size, raw_handle=raw_handle, device_id=device))

    def _free_name(self, name) -> None:
        if not isinstance(name, str) or not name or len(name) > 255:
            raise ShmError(f"a shared memory region's name must be a non-empty string, got {name!r}"[:200])
        if name in self._regions:
            raise ShmError(f"shared memory region {name!r} is registered already: unregister it first")

    def _add(self, region: Region) -> Region:
        self._generation += 1
        region = replace(region, generation=self._generation)
        self._regions[region.name] = region
        return region

    def unregister(self, name: str | None = None, kind: str = "system") -> list[str]:
        """Unregister ``name`` (an unknown name, or one of the other ``kind``, is not an error, as in Triton), or
        every region of ``kind`` (``"system"``, ``"cuda"``) with ``None`` or ``""``; returns the names removed."""
        if not name:
            names = [n for n, r in self._regions.items() if r.kind == kind]
        else:
            names = [name] if name in self._regions and self._regions[name].kind == kind else []
        for n in names:
            del self._regions[n]
        return names

    def status(self, name: str | None = None, kind: str = "system") -> list[dict]:
        """Triton's status of the regions of ``kind``: every one (``None``/``""``) or the one named;
        :class:`ShmError` for a name not registered as that kind."""
        if not name:
            return [r.status() for r in self._regions.values() if r.kind == kind]
        return [self.get(name, kind).status()]

    def get(self, name: str, kind: str | None = None) -> Region:
        """Region ``name`` (of ``kind`` when given); :class:`ShmError` when none is registered under it."""
        region = self._regions.get(name)
        if region is None or (kind is not None and region.kind != kind):
            what = "" if kind is None else f"{kind} "
            raise ShmError(f"{what}shared memory region {str(name)[:100]!r} is not registered")
        return region

    def lookup(self, names) -> dict[str, Region]:
        """The regions of ``names`` that are registered (unknown names are left out: the caller says which)."""
        return {n: self._regions[n] for n in names if n in self._regions}

    def __len__(self) -> int:
        return len(self._regions)


def check_object(region: Region) -> None:
    """Raise :class:`ShmError` unless region ``region`` lies inside its shared memory object (checked on
    registration, where the registering process can see the object)."""
    size = object_size(region.key)
    if region.offset + region.byte_size > size:
        raise ShmError(f"region {region.name!r}: offset {region.offset} + byte_size {region.byte_size} is past the "
                       f"end of shared memory object {region.key!r} ({size} bytes)")


@dataclass(frozen=True)
class Ref:
    """One tensor's reference into a region: ``byte_size`` bytes at ``offset`` of region ``region`` (checked)."""

    region: Region
    offset: int
    byte_size: int


def uses_shm(params: Mapping | None) -> bool:
    """Whether a tensor's ``params`` name a shared memory region."""
    return bool(params) and REGION in params


def region_only(where: str, other: str | None) -> None:
    """Raise :class:`ShmError` (a 400) when an input that names a region also carries its bytes another way
    (``other`` names how: REST's ``'data'`` or ``binary_data_size``, gRPC's ``contents``); ``None``: it does not.
    Checked before the region is read: the other bytes were ignored or misnamed in the refusal."""
    if other:
        raise ShmError(f"{where}: {REGION} and {other} in one input (give its bytes one way)")


def reference(params: Mapping[str, Any], where: str, regions: Mapping[str, Region]) -> Ref:
    """Check the reference of one tensor (``where``: ``"input 'x'"``, ``"output 'y'"``) against ``regions`` (the
    registered ones by name) before any byte is read or written.

    Raises:
        ShmError: an unknown region (``shared_memory_region``), an offset or size that is not an integer >= 0
            (the parameter is named), ``shared_memory_byte_size`` missing, ``shared_memory_offset`` past the end of
            the region, or offset + size past it (``shared_memory_byte_size``).
    """
    name = params.get(REGION)
    if not isinstance(name, str):
        raise ShmError(f"{where}: {REGION} must be a string, got {name!r}"[:200])
    region = regions.get(name)
    if region is None:
        raise ShmError(f"{where}: {REGION} {name[:100]!r} is not a registered shared memory region")
    offset = _int(params.get(OFFSET, 0), f"{where}: {OFFSET}")
    if BYTE_SIZE not in params:
        raise ShmError(f"{where}: {BYTE_SIZE} is missing (with {REGION})")
    size = _int(params.get(BYTE_SIZE), f"{where}: {BYTE_SIZE}")
    if offset > region.byte_size or (offset == region.byte_size and size):
        raise ShmError(f"{where}: {OFFSET} {offset} is past the end of region {name!r} ({region.byte_size} bytes)")
    if offset + size > region.byte_size:
        raise ShmError(f"{where}: {BYTE_SIZE} {size} at {OFFSET} {offset} is past the end of region {name!r} "
                       f"({region.byte_size} bytes)")
    return Ref(region, offset, size)


class Maps:
    """The shared memory objects this process has open, by region name, one descriptor per generation (a name
    registered again is opened again). :meth:`read` copies a reference's bytes out (``os.pread``), :meth:`write`
    copies bytes in (``os.pwrite``): through the descriptor, never a mapping, so a client that shrinks its object
    while a request reads it gets a :class:`ShmError` (a short read), never a SIGBUS that kills the process and every
    client's registrations with it. Objects are opened without blocking and must be regular files (a FIFO put in
    ``/dev/shm`` is refused, not waited on). :meth:`pin` gives a request its own descriptor of a region's object:
    its outputs go to the object that was registered when the request was checked, even if the name is
    unregistered and the key made again by someone else before they are written."""

    def __init__(self):
        self._fds: dict[str, tuple[int, int]] = {}  # name -> (generation, fd)

    def _fd(self, region: Region) -> int:
        held = self._fds.get(region.name)
        if held is not None and held[0] == region.generation:
            return held[1]
        self.drop(region.name)
        path = os.path.join(SHM_DIR, check_key(region.key))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            _out_of_descriptors(exc)
            raise ShmError(f"region {region.name!r}: cannot open shared memory key {region.key!r} "
                           f"({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(f"region {region.name!r}: shared memory key {region.key!r} is not a shared memory "
                               "object")
            end = region.offset + region.byte_size
            if st.st_size < end:
                raise ShmError(f"region {region.name!r}: shared memory object {region.key!r} is smaller than offset "
                               f"+ byte_size ({end} bytes)")
        except BaseException:
            os.close(fd)
            raise
        self._fds[region.name] = (region.generation, fd)
        return fd

    def pin(self, region: Region) -> int:
        """A descriptor of ``region``'s object of its own (``os.dup``; the caller closes it): what a request writes
        its outputs through. Raises :class:`ShmError` as :meth:`read` does, a 503 :class:`ProtocolError` when the
        process has no descriptor left."""
        fd = self._fd(region)
        try:
            return os.dup(fd)
        except OSError as exc:
            _out_of_descriptors(exc)
            raise

    def read(self, ref: Ref) -> bytes:
        """A copy of the ``ref.byte_size`` bytes ``ref`` names. Raises :class:`ShmError` when the object cannot be
        opened or is shorter than the reference (it shrank)."""
        fd = self._fd(ref.region)
        start, n = ref.region.offset + ref.offset, ref.byte_size
        parts, got = [], 0
        while got < n:  # Linux reads at most 2 GiB - 4 KiB per call
            part = os.pread(fd, n - got, start + got)
            if not part:
                self.drop(ref.region.name)
                raise ShmError(f"region {ref.region.name!r}: its shared memory object {ref.region.key!r} shrank "
                               "below the region after it was registered")
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def write(self, ref: Ref, data, where: str, fd: int | None = None) -> None:
        """Copy ``data`` (bytes-like) to where ``ref`` points (through ``fd``, a :meth:`pin` of its region, when
        given). Raises :class:`ShmError` when it is larger than ``ref.byte_size`` (``where`` names the tensor) or
        the object shrank below it (nothing is written)."""
        view = memoryview(data).cast("B")
        if view.nbytes > ref.byte_size:
            raise ShmError(f"{where}: {view.nbytes} bytes do not fit its {BYTE_SIZE} of {ref.byte_size}")
        fd = self._fd(ref.region) if fd is None else fd
        start = ref.region.offset + ref.offset
        if os.fstat(fd).st_size < start + view.nbytes:  # pwrite would grow it back: the client shrank it
            raise ShmError(f"region {ref.region.name!r}: its shared memory object {ref.region.key!r} shrank below "
                           "the region after it was registered")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(fd, view[done:], start + done)

    def drop(self, name: str) -> None:
        """Close region ``name``'s object (nothing when it is not open)."""
        held = self._fds.pop(name, None)
        if held is not None:
            os.close(held[1])

    def keep_only(self, live: Mapping[str, Region]) -> None:
        """Close every region's object that is not in ``live`` with the same generation."""
        for name, (gen, _) in list(self._fds.items()):
            if name not in live or live[name].generation != gen:
                self.drop(name)

    def names(self) -> list[str]:
        """The names of the regions whose objects are open here."""
        return sorted(self._fds)

    def close(self) -> None:
        """Close every region's object."""
        for name in list(self._fds):
            self.drop(name)

    def __len__(self) -> int:
        return len(self._fds)


def _out_of_descriptors(exc: OSError) -> None:
    """Raise a 503 :class:`ProtocolError` when ``exc`` says this process has no file descriptor left (the server's
    state, not the client's region)."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        raise ProtocolError(f"the server has no file descriptor left to open a shared memory region ({exc.strerror});"
                            " retry later", 503) from None


def is_loopback(peer: str | None) -> bool:
    """Whether ``peer`` (an address: ``127.0.0.1``, ``::1``, or gRPC's ``ipv4:127.0.0.1:PORT``,
    ``ipv6:[::1]:PORT``, ``unix:...``) is on this machine. ``None`` or anything unparsable: no."""
    if not peer:
        return False
    p = peer.strip()
    if p.startswith("unix:"):
        return True
    if p.startswith("ipv4:"):
        p = p[5:].rsplit(":", 1)[0]
    elif p.startswith("ipv6:"):
        p = unquote(p[5:])  # gRPC writes ipv6:%5B::1%5D:PORT
        if p.startswith("["):
            p = p[1:].split("]", 1)[0]
    try:
        addr = ipaddress.ip_address(p.split("%", 1)[0])
    except ValueError:
        return p == "localhost"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback
