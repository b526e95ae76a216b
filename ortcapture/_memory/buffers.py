"""Fixed device buffers: one allocation function, and the raw IOBinding path's per-session pool.

A captured graph replays into the exact device buffers it was captured with, so a buffer a graph still uses must
never be freed under it (replay would write into freed memory). Who keeps a buffer alive:

* a :class:`~ortcapture.graph.CapturedGraph` owns its buffers (allocated with :func:`allocate`; freed once it is
  released and no handed-out output references them, or when it is collected);
* the registry record of a captured ``gpu_graph_id`` holds every OrtValue its IOBinding pinned;
* ``InferenceSession.allocate()`` (the raw IOBinding path) hands buffers to the caller; the session's
  :class:`BufferPool` only tracks them (weakly): a buffer lives while the caller, an IOBinding (ORT's C binding
  holds what is bound) or a captured graph's registry record holds it. Releasing a graph drops its record, so the
  buffers only it pinned are freed (measured before on the software adapter: +4 MiB per capture -> replay ->
  release cycle with two 2 MiB buffers, every buffer kept until the session died).
"""
from __future__ import annotations

import math
import operator
import threading
import weakref
from typing import Sequence

import numpy as np

from ortcapture._ort import compat
from ortcapture._ort.compat import OrtInferenceSession, OrtValue
from ortcapture._ort.providers import CaptureInfo
from ortcapture._ort.values import BFLOAT16, STORAGE, check_webgpu_bytes, remember
from ortcapture.errors import CaptureUnsupportedError, TransferError


def _check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)  # ints only: 2.7 must not become 2
    except (TypeError, ValueError):
        raise TransferError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise TransferError(f"shape {dims} has a negative or symbolic dim; fixed buffers need concrete dims")
    return dims


def allocate(session, info: CaptureInfo, shape: Sequence[int], dtype) -> OrtValue:
    """A new uninitialised OrtValue on the capturing EP's device.

    Args:
        session: the ORT session; WebGPU buffers come from its own allocator
            (``InferenceSession.create_ortvalue_from_shape_and_type``, ORT >= 1.30), others from ORT's shared device
            allocator (``OrtValue.ortvalue_from_shape_and_type``).
        info: the capturing EP and device ordinal (``cuda:<device_id>`` or ``webgpu``).
        shape: concrete dims, ints >= 0.
        dtype: a numpy dtype; bfloat16 is ``ml_dtypes.bfloat16`` (CUDA and CPU only: the WebGPU EP has no bfloat16
            kernels).

    Returns:
        The OrtValue, with its device kind and ordinal recorded (:func:`ortcapture._ort.values.remember`).

    Raises:
        TransferError: a bad shape, or a dtype or device ORT cannot allocate; a WebGPU buffer over 2 GiB - 1
            (:data:`ortcapture._ort.values.WEBGPU_MAX_BYTES`).
        CaptureUnsupportedError: bfloat16 on WebGPU.
    """
    dims = _check_shape(shape)
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise TransferError(f"dtype {dtype!r} is not a numpy dtype") from None
    kind, dev = info.device_type, info.device_id
    storage = STORAGE.get(np_dtype)
    if np_dtype == BFLOAT16 and kind == "webgpu":
        raise CaptureUnsupportedError("bfloat16 buffers on WebGPU: the WebGPU EP has no bfloat16 kernels (its "
                                      "nodes would fall back to the CPU EP); use float16 or float32 there")
    if kind == "webgpu":
        check_webgpu_bytes(math.prod(dims) * np_dtype.itemsize, f"allocate({list(dims)}, {np_dtype})")
    # ORT allocates the types its numpy bridge does not know (bfloat16) by ONNX element type code
    np_type = storage[1] if storage is not None else np_dtype.type
    try:
        if kind == "webgpu" and compat.has_session_ortvalues():
            value = OrtInferenceSession.create_ortvalue_from_shape_and_type(session, dims, np_type, kind, dev)
        else:
            value = OrtValue.ortvalue_from_shape_and_type(dims, np_type, kind, dev)
    except (RuntimeError, TypeError) as exc:
        raise TransferError(f"cannot allocate {dims} {np.dtype(dtype)} on {kind}:{dev}: {exc}") from exc
    return remember(value, kind, dev)


class BufferPool:
    """The live buffers ``InferenceSession.allocate()`` handed out (the raw IOBinding path), held weakly.

    The pool never keeps a buffer alive: what is bound is held by the IOBinding, what a captured ``gpu_graph_id``
    pinned by its registry record (until it is released), the rest by the caller. A buffer nobody holds is freed.
    """

    def __init__(self, session, info: CaptureInfo):
        self._session = session
        self._info = info
        self._buffers: weakref.WeakSet[OrtValue] = weakref.WeakSet()
        self._lock = threading.Lock()

    def allocate(self, shape: Sequence[int], dtype) -> OrtValue:
        """:func:`allocate`, tracked (weakly) by the pool. Raises :class:`~ortcapture.errors.TransferError` as it
        does."""
        value = allocate(self._session, self._info, shape, dtype)
        with self._lock:
            self._buffers.add(value)
        return value

    def live(self) -> list[OrtValue]:
        """The buffers handed out that are still alive."""
        with self._lock:
            return list(self._buffers)

    @property
    def nbytes(self) -> int:
        """Bytes held by the live buffers of this pool."""
        return sum(int(b.tensor_size_in_bytes()) for b in self.live())

    def __len__(self) -> int:
        return len(self.live())

    def clear(self) -> None:
        """Stop tracking every buffer (the C session that used them is gone)."""
        with self._lock:
            self._buffers = weakref.WeakSet()
