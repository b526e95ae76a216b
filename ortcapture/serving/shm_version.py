"""The shared memory registry's count of changes in node-local shared memory, read without a Ray call.

Issue 45: an ingress replica on the registry actor's node reads it instead of calling the actor for every request
that names a region.

Measured before (H100, 32 gRPC clients with their images in system shared memory, Ray Serve's HAProxy ingress): the
one registry call per request cost the registry actor 0.7-0.9 cores and each busy tier replica ~8 % of its CPU.

* :class:`VersionFile` is the registry's side (:class:`ortcapture.serving.shm_store.RegistryActor`): 8 bytes, the
  count of changes (registrations, unregistrations) as a little-endian integer, in
  ``/dev/shm/ortcapture-registry-<pid>-<32 hex>`` — the server's own prefix, which no client can register as a region
  (:func:`ortcapture.serving.shm.check_key`). A change is counted **before** its call returns, so a request sent after
  a client saw its (un)registration answered reads the new count.
* :class:`VersionReader` is an ingress replica's read-only view of it, through a descriptor (``os.pread``; never a
  mapping, so nothing the file's owner does can raise SIGBUS in the reader). It answers ``None`` — "ask the actor" —
  once the registry's process is gone or a zombie: a registry made again after its actor died is another file, and
  its generations differ from the old registry's (:class:`ortcapture.serving.shm.Regions`).

Files of registries whose process is gone (a registry killed with SIGKILL cannot unlink its own) are unlinked when a
registry is made (:func:`ortcapture.serving.slots.sweep_stale_pools` with this prefix). Linux only: without
``/proc`` a reader is never made and every lookup is an actor call, as before.
"""
from __future__ import annotations

import os
import secrets
import stat

from ortcapture.serving.slots import SHM_DIR, sweep_stale_pools

#: the files' prefix (``<PREFIX>-<pid>-<32 hex>``): the server's own objects (:data:`ortcapture.serving.shm.SERVER_PREFIX`)
PREFIX = "ortcapture-registry"


class VersionFile:
    """The registry's count of changes (:attr:`version`, from 0), written to a new file of its own (``path``).
    Raises ``OSError`` when ``/dev/shm`` cannot hold it (the registry then runs without one)."""

    def __init__(self):
        sweep_stale_pools(PREFIX)
        self.path = os.path.join(SHM_DIR, f"{PREFIX}-{os.getpid()}-{secrets.token_hex(16)}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.version = 0
        try:
            self._write()
        except BaseException:
            self.close()
            raise

    def _write(self) -> None:
        if os.pwrite(self._fd, self.version.to_bytes(8, "little"), 0) != 8:
            raise OSError(f"short write to {self.path}")

    def bump(self) -> int:
        """Count one change (before the call that made it returns); returns the new count."""
        self.version += 1
        self._write()
        return self.version

    def close(self) -> None:
        """Unlink the file and close it (twice is harmless)."""
        if self._fd >= 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = -1


class VersionReader:
    """An ingress replica's view of registry process ``pid``'s :class:`VersionFile` at ``path`` (on this node).
    Raises ``OSError`` (or ``ValueError`` for a path that is not such a file under ``/dev/shm``) when it cannot be
    opened: the caller then asks the actor for every lookup."""

    def __init__(self, path: str, pid: int):
        name = os.path.basename(str(path))
        if os.path.dirname(str(path)) != SHM_DIR or not name.startswith(PREFIX + "-") or "/" in name:
            raise ValueError(f"not a registry's version file: {str(path)[:120]!r}")
        self.path, self.pid = str(path), int(pid)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                raise ValueError(f"not a registry's version file: {self.path[:120]!r}")
            # the registry's process state, read again on every read (a descriptor of /proc/<pid>/stat: ESRCH once
            # the process is reaped, state Z while a zombie)
            self._proc = os.open(f"/proc/{self.pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(self._fd)
            raise

    def read(self) -> int | None:
        """The registry's count of changes, or ``None`` (for good: the reader closes) when its process is gone or a
        zombie, or the file is no longer 8 bytes."""
        if self._fd < 0:
            return None
        try:
            state = os.pread(self._proc, 512, 0).rpartition(b")")[2].split()[:1]
            raw = os.pread(self._fd, 8, 0)
        except OSError:  # ESRCH: the process was reaped
            state, raw = [], b""
        if not state or state[0] in (b"Z", b"X", b"x") or len(raw) != 8:  # reaped, a zombie, dead; or cut short
            self.close()
            return None
        return int.from_bytes(raw, "little")

    def close(self) -> None:
        """Close the descriptors (twice is harmless)."""
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._proc)
            self._fd = -1
