"""Session-scoped fixed device buffers.

A captured graph replays into the exact device buffers it was captured with. :class:`BufferPool` allocates those
buffers on the capturing EP's device and keeps a strong reference to each for the session's lifetime, so a buffer
a graph still uses is never freed under it (freeing it would leave replay writing into freed memory).
"""
from __future__ import annotations

import threading
import weakref
from typing import Sequence

import numpy as np
import onnxruntime as ort

from ortcapture import compat
from ortcapture.errors import TransferError
from ortcapture.providers import CaptureInfo

# OrtValue -> (device kind, ordinal), for what ORT's Python API does not tell reliably: the ordinal is not exposed,
# and before ORT 1.30 device_name() says "cuda" for WebGPU buffers.
_DEVICES: "weakref.WeakKeyDictionary[ort.OrtValue, tuple[str, int]]" = weakref.WeakKeyDictionary()


def device_kind(value: ort.OrtValue) -> str:
    """``"cpu"``, ``"cuda"``, ``"webgpu"``, …: recorded at allocation by ortcapture, else ``device_name()``."""
    try:
        return _DEVICES[value][0]
    except (KeyError, TypeError):
        return value.device_name().lower()


def device_id_of(value: ort.OrtValue) -> int:
    """Device ordinal of ``value``: recorded at allocation by ortcapture, else asked of CUDA, else 0."""
    try:
        return _DEVICES[value][1]
    except (KeyError, TypeError):
        pass
    if value.device_name().lower() == "cuda":  # (or WebGPU before ORT 1.30: then no CUDA device owns it)
        from ortcapture.cudart import pointer_device

        dev = pointer_device(int(value.data_ptr()))
        if dev is not None:
            return dev
    return 0


def remember_device(value: ort.OrtValue, kind: str, device_id: int) -> ort.OrtValue:
    """Record ``value``'s device kind and ordinal (see :func:`device_kind`, :func:`device_id_of`)."""
    try:
        _DEVICES[value] = (kind, int(device_id))
    except TypeError:
        pass
    return value


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise TransferError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise TransferError(f"shape {dims} has a negative or symbolic dim; fixed buffers need concrete dims")
    return dims


class BufferPool:
    """Fixed device buffers owned by one session.

    Buffers are allocated on the capturing EP's device (``cuda:<device_id>`` or ``webgpu``) with the session's own
    allocator where ORT offers one (``InferenceSession.create_ortvalue_from_shape_and_type``, ORT >= 1.30), else
    ORT's shared device allocator.
    """

    def __init__(self, session: ort.InferenceSession, info: CaptureInfo):
        self._session = session
        self._info = info
        self._buffers: list[ort.OrtValue] = []
        self._lock = threading.Lock()

    def allocate(self, shape: Sequence[int], dtype) -> ort.OrtValue:
        """A new uninitialised device OrtValue of ``shape`` (ints >= 0) and numpy ``dtype``.

        Raises :class:`~ortcapture.errors.TransferError` for a bad shape or a dtype ORT cannot hold.
        """
        dims = _check_shape(shape)
        try:
            np_type = np.dtype(dtype).type
        except TypeError:
            raise TransferError(f"dtype {dtype!r} is not a numpy dtype") from None
        kind, dev = self._info.device_type, self._info.device_id
        try:
            if kind == "webgpu" and compat.has_session_ortvalues():
                value = ort.InferenceSession.create_ortvalue_from_shape_and_type(self._session, dims, np_type, kind, dev)
            else:
                value = ort.OrtValue.ortvalue_from_shape_and_type(dims, np_type, kind, dev)
        except (RuntimeError, TypeError) as exc:
            raise TransferError(f"cannot allocate {dims} {np.dtype(dtype)} on {kind}:{dev}: {exc}") from exc
        remember_device(value, kind, dev)
        with self._lock:
            self._buffers.append(value)
        return value

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers of this pool."""
        return sum(int(b.tensor_size_in_bytes()) for b in self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Drop the pool's references (only once no captured graph uses them)."""
        with self._lock:
            self._buffers.clear()
