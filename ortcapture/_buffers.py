"""Session-scoped fixed device buffers.

A captured graph replays into the exact device buffers it was captured with. :class:`BufferPool` allocates those
buffers on the capturing EP's device and keeps a strong reference to each for the session's lifetime, so a buffer
a graph still uses is never freed under it (freeing it would leave replay writing into freed memory).
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import onnxruntime as ort

from ortcapture import _compat as compat
from ortcapture.errors import TransferError
from ortcapture._providers import CaptureInfo
from ortcapture._values import device_id_of, device_kind, remember  # noqa: F401 - re-exported

def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    import operator

    try:
        dims = tuple(operator.index(d) for d in shape)  # ints only: 2.7 must not become 2
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
        remember(value, kind, dev)
        with self._lock:
            self._buffers.append(value)
        return value

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers of this pool."""
        return sum(int(b.tensor_size_in_bytes()) for b in self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def forget(self, values) -> None:
        """Drop the pool's references to ``values`` (buffers of a released graph, or scratch copies); they are
        freed once nothing else holds them. Must not be called for buffers a live captured graph still replays."""
        ids = {id(v) for v in values}
        with self._lock:
            self._buffers = [b for b in self._buffers if id(b) not in ids]

    def clear(self) -> None:
        """Drop the pool's references (only once no captured graph uses them)."""
        with self._lock:
            self._buffers.clear()
