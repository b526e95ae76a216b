"""Triton's CUDA shared memory extension, the device-free half: registration checks and device tensor references.

A client on the server's machine allocates device memory (``tritonclient.utils.cuda_shared_memory``:
``cudaMalloc`` + ``cudaIpcGetMemHandle``), registers it under a server-wide name (``POST
/v2/cudasharedmemory/region/NAME/register`` with ``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}``, or
gRPC's ``CudaSharedMemoryRegister``) and names the region in an input's or a requested output's parameters
(``shared_memory_region``, ``shared_memory_offset``, ``shared_memory_byte_size``), as with system shared memory.

The batching tier has no GPU and never touches the memory: it checks the registration (:func:`check_register`) and
every reference against the region's size (:func:`ortcapture.serving.shm.reference`), and puts a
:class:`DeviceTensor` in the request's feeds where the bytes would be. The request is checked like any other (its
shape and dtype: :meth:`DeviceTensor.stand_in`; there are no value rules on CUDA), batched only with other requests
whose batched inputs come from regions too (:func:`ortcapture.serving.requests.group_key`), and a run's rows go to
the session replica as :class:`DeviceRows` — a few bytes of references, never the tensor. The session replica, which
holds the CUDA context, opens each handle once (``cudaIpcOpenMemHandle``: :mod:`ortcapture.serving.cuda_ipc`),
gathers the rows device to device and feeds them to its graphs through the feed path's device copy; outputs named
into regions are written there by the session replica.

No CUDA import here (the tier and the CPU machine's tests use it).
"""
from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ortcapture.serving.shm import Ref, ShmError

#: bytes of a CUDA IPC memory handle (``CUDA_IPC_HANDLE_SIZE``)
IPC_HANDLE_BYTES = 64


def check_register(name, raw_handle, device_id, byte_size) -> bytes:
    """The handle's bytes of a CUDA registration (``raw_handle``: base64 text or bytes, as ``{"b64": ...}`` carries
    it over HTTP; the raw 64 bytes over gRPC). Raises :class:`~ortcapture.serving.shm.ShmError`: a handle that is
    not base64 of 64 bytes, a ``device_id`` or ``byte_size`` that is not an integer >= 0 (the registry refuses a
    size of 0 and a taken name)."""
    if isinstance(raw_handle, dict):
        raw_handle = raw_handle.get("b64")
    if isinstance(raw_handle, (bytes, bytearray)) and len(raw_handle) == IPC_HANDLE_BYTES:
        handle = bytes(raw_handle)
    elif isinstance(raw_handle, (str, bytes, bytearray)):
        try:
            handle = base64.b64decode(raw_handle, validate=True)
        except (binascii.Error, ValueError):
            raise ShmError(f"region {str(name)[:100]!r}: raw_handle is not base64 (send "
                           "{\"raw_handle\": {\"b64\": <base64 of the cudaIpcMemHandle_t>}})") from None
    else:
        raise ShmError(f"region {str(name)[:100]!r}: raw_handle must be {{\"b64\": <base64 text>}}, got "
                       f"{type(raw_handle).__name__}")
    if len(handle) != IPC_HANDLE_BYTES:
        raise ShmError(f"region {str(name)[:100]!r}: raw_handle is {len(handle)} bytes; a CUDA IPC handle is "
                       f"{IPC_HANDLE_BYTES}")
    for what, v, top in (("device_id", device_id, 2**31), ("byte_size", byte_size, 2**63)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < top:
            raise ShmError(f"region {str(name)[:100]!r}: {what} must be an integer in [0, {top}), got {v!r}"[:200])
    return handle


@dataclass(frozen=True)
class DeviceTensor:
    """One request's input in a CUDA region: ``ref`` (checked against the region's size), the tensor's ``shape``
    and numpy ``dtype`` (``ref.byte_size`` is exactly their bytes, C order). A feed value in the tier's checks;
    picklable, a few bytes."""

    ref: Ref
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        """The tensor's rank."""
        return len(self.shape)

    def stand_in(self) -> np.ndarray:
        """A zero-strided numpy array of this shape and dtype (no memory): what the one request check
        (:class:`ortcapture.serving.requests.RequestCheck`) checks in its place."""
        return np.lib.stride_tricks.as_strided(np.zeros(1, self.dtype), self.shape, (0,) * len(self.shape))


@dataclass(frozen=True)
class DeviceRows:
    """A run's rows of one input from CUDA regions, joined along axis 0: ``parts`` ``[(DeviceTensor, first row,
    end row)]`` in order; ``shape`` and ``dtype`` of the joined tensor. The session replica gathers them on the
    device (:meth:`ortcapture.serving.cuda_ipc.IpcMemory.gather`)."""

    parts: tuple[tuple[DeviceTensor, int, int], ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, parts: Sequence[tuple[DeviceTensor, int, int]]) -> "DeviceRows":
        """The rows ``parts`` (``[(DeviceTensor, first row, end row)]``, at least one) joined along axis 0."""
        first = parts[0][0]
        rows = sum(stop - start for _, start, stop in parts)
        return cls(tuple(parts), (rows, *first.shape[1:]), first.dtype)


def device_expected(t: dict, specs: dict) -> tuple[tuple[int, ...], np.dtype] | None:
    """``(shape, numpy dtype)`` of an input entry ``t`` (``{"name", "datatype", "shape"}``) of a region, when its
    datatype is its input's and its shape a list of integers >= 0; ``None`` otherwise (the protocol says what is
    wrong)."""
    s = specs.get(t.get("name"))
    shape = t.get("shape")
    if s is None or t.get("datatype") != s.datatype or not isinstance(shape, (list, tuple)):
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return None
    return tuple(int(d) for d in shape), np.dtype(s.dtype)


def device_tensor(ref: Ref, t: dict, specs: dict, where: str) -> DeviceTensor:
    """The :class:`DeviceTensor` of input entry ``t`` naming CUDA region reference ``ref``. Raises
    :class:`~ortcapture.serving.shm.ShmError` when its shape and datatype are not the model's kind or take other
    than ``shared_memory_byte_size`` bytes."""
    got = device_expected(t, specs)
    if got is None:
        raise ShmError(f"{where}: a CUDA shared memory input needs the model's datatype and a shape of integers")
    shape, dtype = got
    need = math.prod(shape) * dtype.itemsize  # Python ints: no wrap-around
    if ref.byte_size != need:
        raise ShmError(f"{where}: shared_memory_byte_size {ref.byte_size}; its shape and datatype take {need} bytes")
    return DeviceTensor(ref, shape, dtype)


@dataclass(frozen=True)
class InRegion:
    """An output the session replica wrote into the request's CUDA region: its shape and dtype, no data. It stands
    in the request's answer where the array would be, so the rows stay on the device (the reference YOLOv8n's
    output is 185 KB an image, which Ray would pickle and copy back to the tier for nothing); the response entry
    needs only ``shape`` and ``nbytes`` (:func:`region_entries`)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, a) -> InRegion:
        """The stand-in of ``a`` (a numpy array, or an :class:`InRegion` already)."""
        return cls(tuple(int(d) for d in a.shape), np.dtype(a.dtype))

    @property
    def nbytes(self) -> int:
        """The output's bytes in its region (as ``numpy.ndarray.nbytes``)."""
        return math.prod(self.shape) * self.dtype.itemsize


def region_entries(outputs, device_outputs: dict[str, Any]) -> list[dict]:
    """Triton's response entries of the outputs written into CUDA regions: ``outputs`` the request's answer (numpy
    arrays, or :class:`InRegion` for those the session replica wrote on the device), ``device_outputs`` ``{output
    name: (Ref, datatype)}``."""
    entries = []
    for name, (ref, datatype) in device_outputs.items():
        a = outputs[name]
        entries.append({"name": name, "datatype": datatype, "shape": [int(d) for d in a.shape],
                        "parameters": {"shared_memory_region": ref.region.name, "shared_memory_offset": ref.offset,
                                       "shared_memory_byte_size": int(a.nbytes)}})
    return entries
