"""``CapturedGraph``: capture once, then ``run(feeds) -> outputs`` with strict in-place updates.

What is captured: one ``gpu_graph_id`` of one session, replaying the model on fixed input and output device
buffers allocated from the example feeds' shapes and dtypes. What must stay static: those shapes and dtypes (feeds
are copied into the fixed buffers; a different shape raises). What silently breaks in raw ORT and is guarded here:
rebinding after capture (ignored by replay), wrong-dtype ``update_inplace`` (bytes reinterpreted), warm-up runs
advancing in-place state (ORT #32243), and output OrtValues overwritten by the next replay.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping

import numpy as np
import onnxruntime as ort

from ortcapture import transfer
from ortcapture.errors import CaptureError, GraphReleasedError, StaleOutputError, TransferError


class ReplayOutput(ort.OrtValue):
    """A fixed output OrtValue as returned by ``CapturedGraph.run(..., copy_outputs=False)``.

    It *is* the graph's fixed device buffer (no copy), so the next replay overwrites it. Reading it through
    ``numpy()``/``np.asarray``/DLPack after that raises :class:`StaleOutputError`; ``is_stale`` tells. Copy what
    you need to keep (``ortcapture.to_numpy``) before the next ``run``.
    """

    def __init__(self, value: ort.OrtValue, graph: "CapturedGraph", generation: int):
        # plain attribute writes instead of OrtValue.__init__: this is on the replay hot path
        self._ortvalue = value._ortvalue
        self._numpy_obj = None
        self._session = getattr(value, "_session", None)
        self._fixed = value  # the registered buffer: its metadata (device kind before ORT 1.30) is known
        self._graph = graph
        self._generation = generation

    @property
    def is_stale(self) -> bool:
        return self._graph._generation != self._generation

    def _check(self) -> None:
        if self.is_stale:
            raise StaleOutputError(
                f"this output of gpu_graph_id={self._graph.graph_id} was overwritten by a later replay "
                f"(generation {self._generation}, now {self._graph._generation}); copy outputs before the next run"
            )

    def numpy(self) -> np.ndarray:
        self._check()
        arr = transfer.to_numpy(self._fixed)
        self._check()  # a replay from another thread began meanwhile: the copy may mix two replays
        return arr

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __dlpack__(self, *, stream=None):
        """Zero-copy export; staleness is checked at export only — the consumer's tensor aliases the fixed buffer
        and shows the next replay's values (copy it, e.g. ``torch.from_dlpack(out).clone()``, to keep them)."""
        self._check()
        return super().__dlpack__(stream=stream)


def _source_spec(name: str, value: Any) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, numpy dtype) of an example feed: numpy array, OrtValue or DLPack tensor."""
    if isinstance(value, ort.OrtValue):
        return tuple(value.shape()), transfer.np_dtype_of(value)
    if isinstance(value, (np.ndarray, np.generic)):
        return tuple(np.shape(value)), value.dtype
    if hasattr(value, "__dlpack__"):
        dt = str(getattr(value, "dtype", "")).replace("torch.", "")
        try:
            return tuple(int(d) for d in value.shape), np.dtype("bool" if dt == "bool" else dt)
        except TypeError:
            pass
    raise TransferError(f"feed {name!r}: unsupported type {type(value).__name__} (numpy, OrtValue or DLPack tensor)")


def _require_mapping(feeds: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(feeds, Mapping):
        raise TransferError(f"{what} must be a mapping {{input name: value}}, got {type(feeds).__name__}")
    return feeds


def _check_model_input(meta, shape: tuple, dtype: np.dtype) -> None:
    """Refuse an example feed whose dtype or fixed dims contradict the model's input (before ORT errors out)."""
    want = transfer.ONNX_TO_NP.get(meta.type)
    if want is not None and dtype != want:
        raise TransferError(f"input {meta.name!r} is {meta.type} in the model; the example feed is {dtype}")
    dims = list(meta.shape or [])
    if dims and (len(dims) != len(shape) or any(isinstance(d, int) and d != s for d, s in zip(dims, shape))):
        raise TransferError(f"input {meta.name!r} has dims {dims} in the model; the example feed has shape {shape}")


class CapturedGraph:
    """A captured ``gpu_graph_id`` with its own fixed input/output buffers. Made by ``sess.capture(feeds)``.

    * ``inputs`` / ``outputs``: name -> fixed device OrtValue (inputs: shapes/dtypes of the example feeds;
      outputs: as the model produced them for those feeds), in ``get_inputs()`` / ``get_outputs()`` order.
    * ``run(feeds)``: copies each given feed into its buffer (exact shape and dtype; numpy, OrtValue or DLPack),
      replays, carries declared state, and returns the outputs as numpy arrays in ``get_outputs()`` order. Inputs
      not in ``feeds`` keep their last values. ``copy_outputs=False`` returns the fixed output buffers as
      :class:`ReplayOutput` (overwritten by the next replay; stale reads raise).
    * ``state={"state_out": "state_in"}``: after each replay the output is copied device-to-device into the
      input, so N runs equal N uncaptured steps; :meth:`reset_state` restores the initial (or given) values.
    * ``release()`` or leaving a ``with`` block releases the graph (CUDA/TensorRT: its id is retired).

    Thread-safe: runs of one session are serialised (ORT does not support concurrent ``Run`` under capture), and
    different sessions' CUDA work waits while any thread captures (:mod:`ortcapture._sync`). CUDA/TensorRT: ORT keeps
    captured graphs per thread, so the first ``run`` from another thread first captures the graph for that thread
    too (side-effect free; once per thread) — reuse long-lived threads rather than new ones per call.
    """

    def __init__(self, session, example_feeds: Mapping[str, Any], graph_id: int, *, state=None, family=None,
                 _without_capture=None):
        """Built by :meth:`InferenceSession.capture`. ``_without_capture=(allocate(shape, dtype), device type, device
        id)``: the same fixed buffers, IOBinding and ``run()`` on a session *without* capture, never captured — the
        one honest "no graph" arm for ``ortcapture bench --no-graph-capture``."""
        self._session = session
        self._family = family if family is not None else session
        self.graph_id = int(graph_id)
        self._released = False
        self._generation = 0
        self._direct: dict = {}  # id(feed) -> (weakref to it, input name, fixed buffer): see run
        if _without_capture is None:
            info = session.capture_info
            base_alloc, device = session.allocate, (info.device_type, info.device_id)
        else:
            base_alloc, device = _without_capture[0], tuple(_without_capture[1:])
        allocated: list[ort.OrtValue] = []

        def alloc(shape, dtype):
            v = base_alloc(shape, dtype)
            allocated.append(v)
            return v

        try:
            self._build(session, example_feeds, state, alloc, device, _without_capture is None)
        except BaseException:
            pool = session._oc_pool  # a failed capture() must not keep its buffers in the session's pool
            if pool is not None and allocated:
                pool.forget(allocated)
            raise

    def _build(self, session, example_feeds, state, alloc, device, capture: bool) -> None:
        from ortcapture.session import run_options_for

        example_feeds = _require_mapping(example_feeds, "example feeds")
        if state is not None and not isinstance(state, Mapping):
            raise CaptureError(f"state must be a mapping {{output name: input name}}, got {type(state).__name__}")
        metas = {m.name: m for m in session.get_inputs()}
        names = list(metas)
        unknown = sorted(set(example_feeds) - set(names))
        if unknown:
            raise TransferError(f"unknown input(s) {unknown}; the model's inputs are {names}")
        missing = [n for n in names if n not in example_feeds]
        if missing:
            raise TransferError(f"example feeds miss input(s) {missing}; capture needs a value for every input")
        self.inputs: dict[str, ort.OrtValue] = {}
        specs = {name: _source_spec(name, example_feeds[name]) for name in names}
        for name, (shape, dtype) in specs.items():
            _check_model_input(metas[name], shape, dtype)
        for name, (shape, dtype) in specs.items():
            self.inputs[name] = alloc(shape, dtype)
            transfer.update_inplace(self.inputs[name], example_feeds[name])
        self.outputs = self._allocate_outputs(alloc, device)
        self._state = self._check_state(state or {})
        self._binding = session.io_binding()
        for name, buf in self.inputs.items():
            self._binding.bind_ortvalue_input(name, buf)
        for name, buf in self.outputs.items():
            self._binding.bind_ortvalue_output(name, buf)
        self._run_options = run_options_for(self.graph_id)
        self._state_src = [self.outputs[o] for o in self._state]
        self._state_dst = [self.inputs[i] for i in self._state.values()]
        self._initial_state = {}
        for iname in self._state.values():
            buf = self.inputs[iname]
            self._initial_state[iname] = alloc(buf.shape(), transfer.np_dtype_of(buf))
        if self._state:
            transfer.copy(self._state_dst, list(self._initial_state.values()))
        if not capture:
            self._record = _NotCaptured()
        else:
            with session._oc_cguard:
                self._record = session._oc_capture(self._binding, self.graph_id, self._run_options, owner=self)
        self._output_list = list(self.outputs.values())

    # -- construction ---------------------------------------------------------------------------------------
    def _allocate_outputs(self, alloc, device: tuple[str, int]) -> dict[str, ort.OrtValue]:
        """Run once without capture (gpu_graph_id=-1) to learn output shapes/dtypes, then allocate fixed buffers."""
        from ortcapture.session import run_options_for

        sess = self._session
        probe = ort.IOBinding(sess)
        for name, buf in self.inputs.items():
            probe.bind_ortvalue_input(name, buf)
        for meta in sess.get_outputs():
            probe.bind_output(meta.name, *device)
        ort.InferenceSession.run_with_iobinding(sess, probe, run_options_for(-1))
        outs = probe.get_outputs()
        return {meta.name: alloc(v.shape(), transfer.np_dtype_of(v)) for meta, v in zip(sess.get_outputs(), outs)}

    def _check_state(self, state: Mapping[str, str]) -> dict[str, str]:
        targets = list(state.values())
        twice = sorted({i for i in targets if targets.count(i) > 1})
        if twice:
            raise CaptureError(f"state input(s) {twice} are fed by more than one state output; each state input "
                               "takes exactly one output")
        for out, inp in state.items():
            if out not in self.outputs:
                raise CaptureError(f"state output {out!r} is not an output of the model ({list(self.outputs)})")
            if inp not in self.inputs:
                raise CaptureError(f"state input {inp!r} is not an input of the model ({list(self.inputs)})")
            o, i = self.outputs[out], self.inputs[inp]
            if tuple(o.shape()) != tuple(i.shape()) or o.data_type() != i.data_type():
                raise CaptureError(
                    f"state {out!r} -> {inp!r}: output is {tuple(o.shape())} {o.data_type()}, input is "
                    f"{tuple(i.shape())} {i.data_type()}; they must match to carry the state"
                )
        return dict(state)

    # -- running --------------------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any] | None = None, *, copy_outputs: bool = True) -> list:
        """Copy ``feeds`` into the fixed inputs, replay, carry state; return outputs (see class docstring).

        Raises :class:`~ortcapture.errors.TransferError` for an unknown input or a shape/dtype mismatch (before any
        buffer is touched) and :class:`~ortcapture.errors.GraphReleasedError` after ``release()``. A feed that is a
        ``copy_outputs=False`` output of *another* graph raises :class:`~ortcapture.errors.StaleOutputError` when
        that graph replays (in another thread) while it is being copied; with several feeds, the ones copied before
        it are then already in the fixed inputs, so feed every input again on the next call.
        """
        # The replay hot path: straight-line code, few calls. On the H200 hosts each Python frame here costs ~1-2 µs
        # right after a replay's wait for the GPU (tools/host_timeline.py), several times its cost back to back.
        sess = self._session
        probe = sess._oc_capture_probe
        if probe is not None and probe():  # before any copy: CUDA calls inside a foreign capture break it
            sess._oc_check_foreign_capture()  # raises CaptureError (ORT PR #32081)
        if not sess._oc_thread_has(self.graph_id):
            with sess._oc_cguard:  # the thread's capture rewrites the outputs: earlier ReplayOutputs go stale
                self._generation += 1
                try:
                    sess._oc_prepare_thread(self._binding, self.graph_id, self._run_options)
                finally:
                    self._generation += 1
        with sess._oc_guard:
            if self._released:
                self._raise_released()
            if feeds is not None and type(feeds) is not dict:
                feeds = _require_mapping(feeds, "feeds")
            if feeds:
                bufs = self.inputs
                if len(feeds) == 1:  # common case: nothing else can fail after this copy
                    for name, value in feeds.items():
                        direct = self._direct.get(id(value))
                        if (direct is not None and direct[0]() is value and direct[1] == name
                                and transfer.COPY_BACKEND is None):
                            # a CUDA OrtValue fed here before: validated then, and nothing about it can change;
                            # the session guard already holds the CUDA gate. Skips update_inplace's call, its
                            # checks and the nested gate entry (~2.5 µs apart on the H200 host, back to back)
                            direct[2].update_inplace(value)
                            continue
                        if name not in bufs:
                            raise TransferError(f"unknown input {name!r}; this graph's inputs are {list(bufs)}")
                        dst = bufs[name]
                        transfer.update_inplace(dst, value)
                        if sess._oc_guard._gate is not None and transfer.direct_copy_ok(dst, value):
                            if len(self._direct) >= 8:  # a few rotating sources (double buffering): the use case
                                self._direct.clear()
                            self._direct[id(value)] = (weakref.ref(value), name, dst)
                else:  # validate every feed before touching any buffer
                    tokens = []
                    for name, value in feeds.items():
                        if name not in bufs:
                            raise TransferError(f"unknown input {name!r}; this graph's inputs are {list(bufs)}")
                        tokens.append(transfer.prepare(bufs[name], value))
                    for token in tokens:
                        transfer.commit(token)
            # a seqlock for ReplayOutput readers: odd while the outputs are being rewritten, even when done, so a
            # read that overlaps a replay from another thread is detected (ReplayOutput.numpy checks before and
            # after). Feeds were copied above, before it turned odd: this graph's own previous outputs may be fed back.
            self._generation += 1
            try:
                sess._oc_replay(self._binding, self._run_options, self._record)
                if self._state:
                    transfer.copy(self._state_src, self._state_dst)
                if copy_outputs:
                    return [transfer.to_numpy(v) for v in self._output_list]
                gen = self._generation + 1  # its value once this returns
                return [ReplayOutput(v, self, gen) for v in self._output_list]
            finally:
                self._generation += 1

    def replay(self) -> None:
        """Replay the graph on its fixed buffers as they are now (no feeds copied, outputs left in :attr:`outputs`,
        declared state carried). For callers that fill :attr:`inputs` themselves (``ortcapture.update_inplace``) and
        read :attr:`outputs` (``ortcapture.to_numpy``). Raises like :meth:`run`."""
        self.run(None, copy_outputs=False)

    def reset_state(self, values: Mapping[str, Any] | None = None) -> None:
        """Restore the state inputs to their values at capture, or to ``values`` (``{input name: array}``)."""
        with self._session._oc_guard:
            if self._released:
                self._raise_released()
            if not self._state:
                raise CaptureError("this graph has no declared state (capture(..., state={out: in}))")
            tokens = []
            for name, value in _require_mapping(values or {}, "values").items():
                if name not in self._initial_state:
                    raise CaptureError(f"{name!r} is not a state input ({list(self._initial_state)})")
                tokens.append(transfer.prepare(self.inputs[name], value))  # all checked before any change
            transfer.copy(list(self._initial_state.values()), self._state_dst)
            for token in tokens:
                transfer.commit(token)

    # -- lifetime -------------------------------------------------------------------------------------------
    @property
    def session(self):
        """The :class:`~ortcapture.InferenceSession` that holds this graph: the session :meth:`capture` was called
        on, or its shape-specialised sibling (see ``capture_deferred``)."""
        return self._session

    @property
    def released(self) -> bool:
        return self._released

    @property
    def replays(self) -> int:
        """Replays of the captured graph so far (the capturing call itself not counted)."""
        return self._record.replays

    def release(self) -> None:
        """Release the captured graph (idempotent, thread-safe). CUDA/TensorRT: the ``gpu_graph_id`` is retired."""
        with self._session._oc_guard:  # two concurrent releases must not release a graph re-captured under the id
            if not self._released:
                self._session.release_captured_graph(self.graph_id)  # ends in _on_released
                self._family._oc_graphs.pop(self.graph_id, None)
                self._on_released()

    def _on_released(self) -> None:
        """The graph is gone (release, release_captured_graph, set_providers): the session's pool lets go of its
        buffers, so capture/release cycles do not accumulate device memory. Outputs handed out earlier keep theirs."""
        if self._released:
            return
        self._released = True
        pool = self._session._oc_pool
        if pool is not None:
            pool.forget([*self.inputs.values(), *self.outputs.values(), *self._initial_state.values()])

    def _raise_released(self):
        raise GraphReleasedError(
            f"gpu_graph_id={self.graph_id} was released (release(), release_captured_graph or set_providers); "
            "capture again with sess.capture(feeds)"
        )

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self.replays} replays"
        info = self._session.capture_info
        ep = info.ep.name if info is not None else "not captured"
        return f"<CapturedGraph gpu_graph_id={self.graph_id} {ep} {state}>"


class _NotCaptured:
    """The registry record's stand-in for a graph built with ``_without_capture``: it only counts runs."""

    __slots__ = ("replays",)

    def __init__(self) -> None:
        self.replays = 0
