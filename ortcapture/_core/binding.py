"""An ``onnxruntime.IOBinding`` that remembers what is bound, so captured graphs can pin it.

ORT's own IOBinding keeps this bookkeeping only from ORT 1.30 on and only enforces it for WebGPU capture
(ORT PR #32074). For CUDA/TensorRT graphs a rebind after capture is accepted and silently ignored: replay reads the
buffers recorded at capture. This subclass records every binding on every ORT version and refuses rebinding or
clearing while a captured ``gpu_graph_id`` pins it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from ortcapture._ort.compat import OrtIOBinding, OrtValue, c_session
from ortcapture._ort.sync import FORKED_DEVICES, origin_of
from ortcapture._ort.values import ONNX_TO_NP, meta
from ortcapture.errors import BindingError


@dataclass(frozen=True)
class Bound:
    """One bound input or output.

    ``kind``: ``"ortvalue"`` (a fixed OrtValue), ``"cpu"`` (``bind_cpu_input``: ORT copies it once, later changes
    are stale on replay), ``"pointer"`` (``bind_input``/``bind_output`` with a raw device pointer, memory owned by
    the caller) or ``"allocate"`` (``bind_output`` without a buffer: ORT allocates per run).
    """

    kind: str
    device: str  # "cpu" | "cuda" | "webgpu" | ...
    device_id: int
    shape: tuple[int, ...] | None
    element_type: str | None  # e.g. "tensor(float)"; None when ORT decides
    address: int | None  # device pointer where one exists (CUDA/CPU); None for WebGPU handles
    value: Any = None  # the OrtValue (strong reference: keeps the buffer alive while pinned)
    owner: Any = None  # a pointer binding's ``owner=`` (strong reference: the memory's owner, e.g. a torch tensor)

    @property
    def key(self) -> tuple:
        """Identity of the buffer: pointer where there is one, else the OrtValue object's identity."""
        ident = self.address if self.address is not None else (id(self.value) if self.value is not None else None)
        return (self.kind, self.device, self.device_id, ident, self.shape, self.element_type)

    @property
    def nbytes(self) -> int:
        """Bytes of the bound buffer: the OrtValue's tensor size, or shape x itemsize of a pointer binding; 0 for
        ``"allocate"`` (ORT allocates per run) and ``"cpu"`` bindings, and where the size is unknown."""
        if self.value is not None:
            try:
                return int(self.value.tensor_size_in_bytes())
            except Exception:  # noqa: BLE001 - older ORT without tensor_size_in_bytes
                pass
        if self.kind == "pointer" and self.shape is not None:  # the byte span the pointer binding declares
            dtype = next((d for d, t in _NP_TO_ONNX.items() if t == self.element_type), None)
            if dtype is not None:
                return int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize
        return 0


#: numpy dtype -> ORT's type string: the inverse of ortcapture's one table (bfloat16 included where ml_dtypes is)
_NP_TO_ONNX = {dtype: name for name, dtype in ONNX_TO_NP.items()}


def onnx_type_of(dtype) -> str:
    """ORT's type string (``"tensor(float)"``) for a numpy dtype; raises :class:`TypeError` for others."""
    try:
        return _NP_TO_ONNX[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise TypeError(f"no ONNX tensor type for numpy dtype {dtype!r}") from None


def describe_ortvalue(value: OrtValue) -> Bound:
    """A :class:`Bound` record for a tensor OrtValue (device kind and ordinal from :mod:`ortcapture._ort.values`)."""
    m = meta(value)
    address = m.span[0] if m.span else None
    return Bound("ortvalue", m.kind, m.device_id, m.shape, m.element_type, address, value)


class IOBinding(OrtIOBinding):
    """Drop-in ``onnxruntime.IOBinding`` that records its bindings and refuses changes while pinned.

    Returned by :meth:`ortcapture.InferenceSession.io_binding`. Every ``bind_*``/``clear_*`` raises
    :class:`~ortcapture.errors.BindingError` while a captured ``gpu_graph_id`` pins this binding; call
    ``sess.release_captured_graph(id)`` first (CUDA/TensorRT: the id is then retired; use a new one).

    In an ``os.fork()`` child of the process that made a device session (CUDA/TensorRT, WebGPU), making one for it,
    and ``copy_outputs_to_cpu``/``synchronize_inputs``/``synchronize_outputs`` of one made before the fork, raise
    :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) before any native call: ORT's device state does
    not survive fork, and those calls would hang or crash without a word.
    """

    def __init__(self, session):
        #: where the session was made (ortcapture._ort.sync.Origin): device calls raise in an os.fork() child of it
        self._oc_origin = origin_of(session)
        if FORKED_DEVICES:
            self._oc_origin.check("io_binding()")
        super().__init__(session)
        # the C session this binding was made for: ORT's SessionIOBinding points into it (ORT < 1.30: a raw pointer,
        # so holding it keeps a binding used after compact()/set_providers from reaching a destroyed session)
        self._oc_c_session = c_session(session)
        #: a WebGPU session: its device pointers are WGPUBuffer handles whatever device_type names them ("gpu" too)
        try:
            self._oc_webgpu = "WebGpuExecutionProvider" in (session.get_providers() or ())
        except Exception:  # noqa: BLE001 - a C session being rebuilt: "webgpu" pointers are still checked
            self._oc_webgpu = False
        self._oc_inputs: dict[str, Bound] = {}
        self._oc_outputs: dict[str, Bound] = {}
        self._oc_pins: set[int] = set()
        self._oc_state: dict[str, str] = {}  # output name -> input name allowed to share one buffer

    def declare_state(self, output_name: str, input_name: str) -> None:
        """Declare that ``output_name`` is bound to the same buffer as ``input_name`` on purpose (recurrent state
        updated in place). Undeclared input/output aliasing is refused under capture. With a declared pair,
        ortcapture snapshots the input before capture and restores it afterwards, so ORT's warm-up runs do not
        advance the state (ORT #32243: 3 steps in the first CUDA-graph call on the H200).
        """
        self._oc_reject_if_pinned("declare state")
        self._oc_state[str(output_name)] = str(input_name)

    @property
    def declared_state(self) -> dict[str, str]:
        """``{output name: input name}`` pairs declared with :meth:`declare_state` (allowed to share one buffer)."""
        return dict(self._oc_state)

    # -- pins: set and cleared by the graph registry (ortcapture._core.registry) only -----------------------------
    @property
    def pinned_ids(self) -> frozenset[int]:
        """The ``gpu_graph_id`` s whose captured graphs pin this binding (bind/clear calls raise while non-empty)."""
        return frozenset(self._oc_pins)

    def pin(self, graph_id: int) -> None:
        """Record that captured graph ``graph_id`` replays this binding's buffers (the registry's call)."""
        self._oc_pins.add(graph_id)

    def unpin(self, graph_id: int) -> None:
        """Forget the pin of ``graph_id`` (released or reset; the registry's call)."""
        self._oc_pins.discard(graph_id)

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def _oc_reject_if_pinned(self, action: str) -> None:
        if self._oc_pins:
            ids = ", ".join(str(i) for i in sorted(self._oc_pins))
            raise BindingError(
                f"Cannot {action}: captured graph(s) gpu_graph_id=[{ids}] pin this IOBinding. Replay re-issues the "
                "device buffers recorded at capture, so the new binding would be silently ignored. Update the "
                "bound buffers in place (ortcapture.update_inplace), or release the graph "
                "(sess.release_captured_graph(id)) and capture under a new gpu_graph_id."
            )

    def capture_signature(self) -> tuple:
        """Hashable identity, shape, dtype and device of everything bound (inputs, then outputs, by name)."""
        return (
            tuple(sorted((n, b.key) for n, b in self._oc_inputs.items())),
            tuple(sorted((n, b.key) for n, b in self._oc_outputs.items())),
        )

    @property
    def bound_inputs(self) -> dict[str, Bound]:
        """``{input name: Bound}``: what each input is bound to now (a copy; the binding's own record)."""
        return dict(self._oc_inputs)

    @property
    def bound_outputs(self) -> dict[str, Bound]:
        """``{output name: Bound}``: what each output is bound to now (a copy; the binding's own record)."""
        return dict(self._oc_outputs)

    # -- ORT API -------------------------------------------------------------------------------------------
    def bind_cpu_input(self, name, arr_on_cpu):
        """ORT's ``bind_cpu_input``: ORT copies the host array ``arr_on_cpu`` (numpy) once, so later changes to
        it are stale on a captured replay. Capture refuses it, except for inputs ORT reads in host memory
        (``get_input_memory_infos()``: a Reshape shape, Slice starts), which are capture-time constants.

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding (release the graph first).
        """
        self._oc_reject_if_pinned("rebind inputs")
        super().bind_cpu_input(name, arr_on_cpu)
        arr = np.asarray(arr_on_cpu)
        self._oc_inputs[name] = Bound("cpu", "cpu", 0, tuple(arr.shape), None, None, arr)

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr, *, owner=None):
        """ORT's pointer binding (``buffer_ptr``: a device address, e.g. ``tensor.data_ptr()``), plus ``owner``: the
        object that owns that memory (the torch tensor, cupy array, OrtValue ...). The binding, and the record of a
        graph captured with it, hold ``owner`` so the memory outlives every replay; without it a pointer binding
        under capture warns :class:`~ortcapture.errors.PointerLifetimeWarning` (replays of freed memory read
        garbage, measured on CUDA: zeros).

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding; or ``buffer_ptr`` is not an int above 0 (0
                only for a tensor of no elements), or ``shape`` has a negative dim (ORT dereferences the pointer in the
                bind itself: a segfault on WebGPU for 0, ORT 1.32); or, with ``device_type`` ``"webgpu"`` (or any
                but ``"cpu"`` on a WebGPU session), ``owner`` is not the WebGPU OrtValue whose ``data_ptr()`` is
                ``buffer_ptr`` (of ``element_type``, with at least ``shape``'s elements): a WebGPU ``buffer_ptr`` is a
                WGPUBuffer handle, and an int that is no live buffer's handle crashes ORT's run (a segfault, ORT
                1.32, uncaptured runs too) — all before ORT is called.
        """
        self._oc_reject_if_pinned("rebind inputs")
        _check_pointer(buffer_ptr, shape, f"bind_input({name!r})")
        self._oc_check_handle(device_type, buffer_ptr, element_type, shape, owner, f"bind_input({name!r})")
        super().bind_input(name, device_type, device_id, element_type, shape, buffer_ptr)
        self._oc_inputs[name] = Bound(
            "pointer", str(device_type).lower(), int(device_id), tuple(shape), onnx_type_of(element_type),
            int(buffer_ptr), None, owner,
        )

    def _oc_check_handle(self, device_type, buffer_ptr, element_type, shape, owner, what: str) -> None:
        """:func:`_check_webgpu_handle` for a pointer that names WebGPU memory: ``device_type`` ``"webgpu"``, or any
        device but the CPU on a WebGPU session (ORT's ``"gpu"`` with vendor 0 is the WebGPU device)."""
        kind = str(device_type).lower()
        if kind == "webgpu" or (self._oc_webgpu and kind != "cpu"):
            _check_webgpu_handle(buffer_ptr, element_type, shape, owner, what)

    def bind_ortvalue_input(self, name, ortvalue):
        """ORT's ``bind_ortvalue_input``: bind a fixed tensor ``OrtValue`` (e.g. ``sess.allocate(shape, dtype)``)
        to input ``name``; the buffer a captured graph replays on.

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding (update the bound buffer in place with
                :func:`ortcapture.update_inplace`, or release the graph first).
        """
        self._oc_reject_if_pinned("rebind inputs")
        super().bind_ortvalue_input(name, ortvalue)
        self._oc_inputs[name] = describe_ortvalue(ortvalue)

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None, *,
                    owner=None):
        """ORT's ``bind_output``; with ``buffer_ptr``, ``owner`` is kept alive and the pointer checked as for
        :meth:`bind_input` (:class:`BindingError`)."""
        self._oc_reject_if_pinned("rebind outputs")
        if buffer_ptr is not None:
            _check_pointer(buffer_ptr, () if shape is None else shape, f"bind_output({name!r})")
            self._oc_check_handle(device_type, buffer_ptr, element_type, () if shape is None else shape, owner,
                                  f"bind_output({name!r})")
        super().bind_output(name, device_type, device_id, element_type, shape, buffer_ptr)
        if buffer_ptr is None:
            rec = Bound("allocate", str(device_type).lower(), int(device_id), None, None, None, None)
        else:
            rec = Bound("pointer", str(device_type).lower(), int(device_id), tuple(shape),
                        onnx_type_of(element_type), int(buffer_ptr), None, owner)
        self._oc_outputs[name] = rec

    def bind_ortvalue_output(self, name, ortvalue):
        """ORT's ``bind_ortvalue_output``: bind a fixed tensor ``OrtValue`` of the output's shape and dtype to
        output ``name``; a captured replay writes into it.

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding (release the graph first).
        """
        self._oc_reject_if_pinned("rebind outputs")
        super().bind_ortvalue_output(name, ortvalue)
        self._oc_outputs[name] = describe_ortvalue(ortvalue)

    def clear_binding_inputs(self):
        """ORT's ``clear_binding_inputs``: forget every input binding.

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding (its replays would ignore the change).
        """
        self._oc_reject_if_pinned("clear input bindings")
        super().clear_binding_inputs()
        self._oc_inputs.clear()

    def clear_binding_outputs(self):
        """ORT's ``clear_binding_outputs``: forget every output binding.

        Raises:
            BindingError: a captured ``gpu_graph_id`` pins this binding (its replays would ignore the change).
        """
        self._oc_reject_if_pinned("clear output bindings")
        super().clear_binding_outputs()
        self._oc_outputs.clear()

    # -- ORT's calls that reach the device ----------------------------------------------------------------------
    def copy_outputs_to_cpu(self):
        """ORT's ``copy_outputs_to_cpu()``. Raises :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) in
        an ``os.fork()`` child of the process that made the session (the device read would hang there)."""
        if FORKED_DEVICES:
            self._oc_origin.check("IOBinding.copy_outputs_to_cpu()")
        return super().copy_outputs_to_cpu()

    def synchronize_inputs(self):
        """ORT's ``synchronize_inputs()``; raises in an ``os.fork()`` child as :meth:`copy_outputs_to_cpu`."""
        if FORKED_DEVICES:
            self._oc_origin.check("IOBinding.synchronize_inputs()")
        return super().synchronize_inputs()

    def synchronize_outputs(self):
        """ORT's ``synchronize_outputs()``; raises in an ``os.fork()`` child as :meth:`copy_outputs_to_cpu`."""
        if FORKED_DEVICES:
            self._oc_origin.check("IOBinding.synchronize_outputs()")
        return super().synchronize_outputs()


def _check_webgpu_handle(buffer_ptr, element_type, shape, owner, what: str) -> None:
    """Refuse a WebGPU pointer binding unless ``owner`` is the WebGPU ``OrtValue`` whose handle ``buffer_ptr`` is, of
    ``element_type`` with at least ``shape``'s elements. On WebGPU ``data_ptr()`` is a WGPUBuffer handle, not an
    address: ORT takes any int and its run dereferences it (a segfault for one that is no live buffer's handle,
    measured on ORT 1.32 with plugin EP 0.4.0, captured or not), and only the owner can vouch for it."""
    try:
        m = meta(owner) if isinstance(owner, OrtValue) else None
    except Exception:  # noqa: BLE001 - not a tensor OrtValue: no owner that can vouch
        m = None
    if m is None or m.kind != "webgpu" or owner.data_ptr() != int(buffer_ptr):
        raise BindingError(
            f"{what}: a WebGPU buffer_ptr is a WGPUBuffer handle, not an address, and one that is not a live buffer's "
            "crashes ORT's run; pass owner= the WebGPU OrtValue it came from (sess.allocate), whose data_ptr() it "
            "is, or bind that OrtValue with bind_ortvalue_input/bind_ortvalue_output")
    try:
        same_type = onnx_type_of(element_type) == m.element_type
    except TypeError:
        same_type = False
    if not same_type or math.prod(int(d) for d in shape) > math.prod(m.shape):
        raise BindingError(
            f"{what}: binds {list(shape)} of {element_type!r} over its owner's {list(m.shape)} of {m.element_type}: "
            "a WebGPU handle binding takes the owner's element type and at most its elements")


def _check_pointer(buffer_ptr, shape, what: str) -> None:
    """Refuse a pointer binding ORT would crash on before it is called: ``buffer_ptr`` not an int, negative, or 0 for
    a tensor with elements (an empty tensor's pointer may be 0: torch's and CuPy's are), a negative dim in ``shape``.
    (A pointer to memory that is not there cannot be told apart here: the caller's to get right.)"""
    import numbers

    dims = list(shape)
    if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or int(d) < 0 for d in dims):
        raise BindingError(f"{what}: shape must be non-negative ints, got {dims!r}")
    empty = any(int(d) == 0 for d in dims)
    if (isinstance(buffer_ptr, bool) or not isinstance(buffer_ptr, numbers.Integral) or int(buffer_ptr) < 0
            or (int(buffer_ptr) == 0 and not empty)):
        raise BindingError(f"{what}: buffer_ptr must be a device address (an int above 0; 0 only for a tensor of no "
                           f"elements), got {buffer_ptr!r}")
