"""``CapturedGraph``: capture once, then ``run(feeds) -> outputs`` with strict in-place updates.

What is captured: one ``gpu_graph_id`` of one session, replaying the model on fixed input and output device
buffers allocated from the example feeds' shapes and dtypes. What must stay static: those shapes and dtypes (feeds
are copied into the fixed buffers; a different shape raises). What silently breaks in raw ORT and is guarded here:
rebinding after capture (ignored by replay), wrong-dtype ``update_inplace`` (bytes reinterpreted), warm-up runs
advancing in-place state (ORT #32243), and output OrtValues overwritten by the next replay.

Moved out of :mod:`ortcapture.graph` (its public face); the outputs, the feeds' checks and ``run_many``'s steps are
:mod:`ortcapture._core.outputs`, :mod:`~ortcapture._core.specs` and :mod:`~ortcapture._core.many`.
"""
from __future__ import annotations

import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from ortcapture._core import many as _many
from ortcapture._core import outputs as _outputs
from ortcapture._core import rows as _rows
from ortcapture._core import specs as _specs
from ortcapture._core.binding import IOBinding
from ortcapture._core.outputs import ReplayOutput
from ortcapture._core.reference import check_frozen
from ortcapture._core.run import run_options_for
from ortcapture._core.specs import example_specs
from ortcapture._memory import compact as _compact
from ortcapture._ort import compat
from ortcapture._ort.compat import OrtValue
from ortcapture._ort import sync as _sync
from ortcapture._ort.sync import FORKED_DEVICES, UNSETTLED, hold
from ortcapture._ort.values import meta
from ortcapture._transfer import check as tcheck
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer import staging as _staging
from ortcapture._transfer import targets as ttargets
from ortcapture.errors import CaptureError, GraphReleasedError, TransferError

_new = object.__new__


class CapturedGraph:
    """A captured ``gpu_graph_id`` with its own fixed input/output buffers. Made by ``sess.capture(feeds)``.

    * ``inputs`` / ``outputs``: name -> fixed device OrtValue (inputs: shapes/dtypes of the example feeds;
      outputs: as the model produced them for those feeds), in ``get_inputs()`` / ``get_outputs()`` order (an output
      the model lists twice has one entry). The graph
      owns them: they are freed once it is released (or collected) and nothing else holds them.
    * ``run(feeds)``: copies each given feed into its buffer (exact shape and dtype; numpy, OrtValue or DLPack),
      replays, carries declared state, and returns the outputs as numpy arrays in ``get_outputs()`` order. Inputs
      not in ``feeds`` keep their last values. ``copy_outputs=False`` returns the fixed output buffers as
      :class:`ReplayOutput` (overwritten by the next replay; stale reads raise).
    * ``state={"state_out": "state_in"}``: after each replay the output is copied device-to-device into the
      input, so N runs equal N uncaptured steps; :meth:`reset_state` restores the initial (or given) values.
    * ``release()`` or leaving a ``with`` block releases the graph (CUDA/TensorRT: its id is retired).
    * In an ``os.fork()`` child of the process that captured it, ``run``/``run_many``/``replay`` and every other
      call that would reach the device raise :class:`~ortcapture.errors.CaptureError` (``kind`` ``"fork"``) before
      any native call — ORT's device state does not survive fork, and the replay would hang without a word
      (measured on WebGPU) — and ``release()`` only marks the graph released (the child never frees its buffers).

    Thread-safe: runs of one session are serialised (ORT does not support concurrent ``Run`` under capture), and
    different sessions' CUDA work waits while any thread captures (:mod:`ortcapture._ort.sync`). CUDA/TensorRT: ORT
    keeps captured graphs per thread, so the first ``run`` from another thread first captures the graph for that
    thread too (side-effect free; once per thread) — reuse long-lived threads rather than new ones per call.

    The graph talks to its session only through the session's :class:`ortcapture._core.state.CaptureState`.
    """

    #: ``{input name: fixed device OrtValue}`` (the example feeds' shapes and dtypes), in ``get_inputs()`` order
    inputs: dict[str, OrtValue]
    #: ``{output name: fixed device OrtValue}`` (as the model produced them for the example), in ``get_outputs()``
    #: order; every replay rewrites them
    outputs: dict[str, OrtValue]

    def __init__(self, capture_state, example_feeds: Mapping[str, Any], graph_id: int, *,
                 state: Mapping[str, str] | None = None, capture: bool = True, device=None):
        """Built by :meth:`InferenceSession.capture` (``capture=True``) or ``InferenceSession.uncaptured_graph``
        (``capture=False``, ``graph_id=-1``: the same buffers, binding and :meth:`run`, never captured)."""
        self._cs = capture_state
        self.graph_id = int(graph_id)
        self._released = False
        self._generation = 0
        self._captured = bool(capture)
        self._record = None
        self._frozen: dict = {}  # host-read inputs -> their capture-time values (freeze_inputs)
        self._copies: list = []  # capture(..., copies=N): the other N-1 graphs of run_many's buffer sets
        self._many = None  # the thread ident of a run_many iterating over this graph now
        #: the capture-time verification's ``ortcapture._verify.compare.Report`` (level, input sets, not varied, max error
        #: per output, seconds); ``None`` before it ran
        self.verification = None
        where = self._device = device if device is not None else capture_state.device
        session = capture_state.session
        if capture:
            new_buffer = capture_state.new_buffer
        else:
            from ortcapture._memory.buffers import allocate

            def new_buffer(shape, dtype):
                with capture_state.guard:
                    return allocate(session, where, shape, dtype)
        try:
            self._build(example_feeds, state, new_buffer)
        except BaseException:
            self._drop_buffers()  # a failed capture() keeps nothing alive
            raise
        hold(self, capture_state.origin)  # an os.fork() child never frees its buffers (ortcapture._ort.sync.Origin)

    def _build(self, example_feeds, state, new_buffer) -> None:
        cs = self._cs
        session = cs.session
        if state is not None and not isinstance(state, Mapping):
            raise CaptureError(f"state must be a mapping {{output name: input name}}, got {type(state).__name__}")
        specs = example_specs(session, example_feeds)
        #: the pool key of this graph: ((input name, shape, dtype), ...) in input order
        self.shape_key = tuple((name, shape, str(dtype)) for name, (shape, dtype) in specs.items())
        self.inputs: dict[str, OrtValue] = {name: new_buffer(shape, dtype) for name, (shape, dtype) in specs.items()}
        self.outputs: dict[str, OrtValue] = {}
        self._initial_state: dict[str, OrtValue] = {}
        ttargets.copy_feeds(self.inputs, example_feeds)
        # int64 feeds that came device to device (WebGPU OrtValues) are range-checked once, here (host ones were)
        tcopy.check_int64_inputs(self.inputs, [n for n, v in example_feeds.items() if not isinstance(v, np.ndarray)])
        self.outputs = self._allocate_outputs(new_buffer)
        self._state = self._check_state(state or {})
        self._binding = IOBinding(session)
        self._binding.host_values_checked = True  # host-read inputs: values checked by run() (freeze_inputs)
        for name, buf in self.inputs.items():
            self._binding.bind_ortvalue_input(name, buf)
        for name, buf in self.outputs.items():
            self._binding.bind_ortvalue_output(name, buf)
        self._run_options = run_options_for(self.graph_id)
        self._state_src = [self.outputs[o] for o in self._state]
        self._state_dst = [self.inputs[i] for i in self._state.values()]
        for iname in self._state.values():
            buf = self.inputs[iname]
            self._initial_state[iname] = new_buffer(buf.shape(), tcheck.np_dtype_of(buf))
        if self._state:
            tcopy.copy(self._state_dst, list(self._initial_state.values()))
        if not self._captured:
            self._record = _NotCaptured()
        else:
            with cs.capture_guard:
                self._record = cs.capture(self._binding, self.graph_id, self._run_options, owner=self)
        # one entry per get_outputs() entry, as ORT returns them: a value listed twice as a graph output (ONNX allows
        # [Y, Z, Y]) is one fixed buffer, returned at each of its positions
        self._output_list = [self.outputs[m.name] for m in session.get_outputs()]
        self._output_names = [m.name for m in session.get_outputs()]
        self._plan()

    # -- construction ---------------------------------------------------------------------------------------
    # methods defined in ortcapture._core.outputs (the outputs) and ortcapture._core.specs (the state check)
    _allocate_outputs = _outputs.allocate_outputs
    _check_outputs_arg = _outputs.check_outputs_arg
    _host_outputs = _outputs.host_outputs
    _check_state = _specs.check_state

    # -- running --------------------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, Any] | None = None, *, copy_outputs: bool | str = True,
            out: Mapping[str, np.ndarray] | Sequence[np.ndarray | None] | None = None) -> list:
        """Copy ``feeds`` into the fixed inputs, replay, carry state; return outputs (see class docstring).

        Args:
            feeds: ``{input name: value}`` (numpy array, OrtValue on any device, DLPack tensor), each exactly the
                shape and dtype of its fixed input; ``None`` or ``{}``: replay on the inputs as they are.
                A numpy feed that is this graph's own :attr:`host_inputs` array is sent without a host copy. A CUDA
                ``OrtValue`` fed again (same object, same device) is copied on the session's compute stream
                (:attr:`ortcapture.InferenceSession.compute_stream`) ahead of the replay, ordered after the work
                queued on the calling thread's legacy stream, with no host wait (ORT's synchronous copy where the
                stream is not known or the calling thread's current device is another).
            copy_outputs: True: new host numpy arrays; False: the fixed output buffers as :class:`ReplayOutput`;
                ``"pinned"``: the graph's own :attr:`host_outputs` arrays (page-locked on CUDA), no copy — they are
                overwritten by this graph's next replay returning host outputs (any thread's), so copy what you keep.
            out: arrays to write the outputs into (numpy, each exactly its output's shape and dtype, writeable):
                ``{output name: array}`` or one entry per ``get_outputs()`` position (``None``: a new array there).
                Outputs not named come back as new arrays; the returned list holds the ``out`` arrays themselves.
                Only with ``copy_outputs=True``.

        Returns:
            One output per ``session.get_outputs()`` entry, in that order, as ORT's ``run`` returns them (a value the
            model lists twice as an output comes back at each position, as separate arrays; with
            ``copy_outputs="pinned"``, as the same array).

        Host data in and out (numpy feeds, host outputs): on CUDA with cuda-python the graph stages it in page-locked
        buffers of its own (:attr:`host_inputs` / :attr:`host_outputs`, ``host_staging == "pinned"``): a numpy feed
        is copied into its buffer in 1 MiB chunks claimed by ``ORTCAPTURE_STAGING_THREADS`` threads (default 3, the
        caller among them), each chunk sent with ``cudaMemcpyAsync`` on the graph's copy stream as soon as it is in,
        and with ``copy_outputs=True`` each output is read with one DMA into a page-locked block of a recycling pool that
        becomes the returned array (the block goes back to the pool when the array is gone; inside
        :func:`ortcapture.transfer.outputs_into`, into the caller's buffer instead). A numpy feed fed again
        (the same array object, same address and size, memory numpy owns: a request buffer reused) is page-locked in
        place on its
        second call (``cudaHostRegister``) and from then on sent with one DMA from its own memory, no host copy
        (9.8 MB: 190 µs); the graph keeps up to 4 such arrays per input alive and locked (256 MiB at most,
        ``ORTCAPTURE_REGISTER_BYTES``) until they are evicted or :meth:`release` (``ORTCAPTURE_REGISTER=0``: off).
        Measured on the H200
        (YOLOv8n batch 8): the 9.8 MB input 613 µs this way against 756 µs from pageable memory (ORT's
        ``update_inplace``), the 1.48 MB output 36 µs against 202 µs. Plain numpy feeds and ``copy_outputs=True``
        take that path unasked for graphs whose inputs and outputs hold at least 1 MiB
        (``ORTCAPTURE_PINNED_MIN=BYTES`` sets the size, ``off`` keeps ORT's pageable path until :attr:`host_inputs`,
        :attr:`host_outputs`, ``copy_outputs="pinned"``, ``out=`` or :meth:`run_many` ask for staging); smaller
        graphs keep ORT's own pageable path and pin nothing. Elsewhere (WebGPU has no page-locked memory; CPU; no
        cuda-python; ``ORTCAPTURE_PINNED=0``) the buffers are ordinary numpy arrays (``host_staging ==
        "pageable"``), numpy feeds take ``update_inplace``'s path as before, and host outputs are read straight into
        the graph's arrays.

        Raises:
            TransferError: an unknown input or a shape/dtype/device mismatch (before any buffer is touched); an
                ``out`` array of the wrong type, shape or dtype, or read-only, or ``out`` with ``copy_outputs`` not
                True, or an unknown ``copy_outputs`` string (before anything is copied or run).
            TypeError: ``copy_outputs`` is neither a bool nor a string (a truthy or falsy value of another type,
                e.g. 1 or ``None``, is no answer), before anything is copied or run.
            GraphReleasedError: after ``release()``.
            StaleOutputError: a feed that is a ``copy_outputs=False`` output of another graph replayed meanwhile
                (in another thread) while it was being copied; with several feeds, the ones copied before it are
                then already in the fixed inputs, so feed every input again on the next call.
            CaptureError: a foreign CUDA graph capture is in progress — torch's current stream (inside
                ``torch.cuda.graph()``) or a blocking stream of the calling thread's current CUDA device, from any
                thread (ORT PR #32081); or a host-read input (``get_input_memory_infos()``: Reshape shape, Slice
                starts, Clip bounds, ...) fed a value other than the capture's (a replay would silently keep the
                capture-time value); or (``kind`` ``"fork"``) this is an ``os.fork()`` child of the process that
                captured the graph: ORT's device state does not survive fork (the replay would hang or crash without
                a word; measured on WebGPU, ORT 1.32).
        """
        # The replay hot path: straight-line code, few calls. On the H200 hosts each Python frame here costs ~1-2 µs
        # right after a replay's wait for the GPU, several times its cost back to back.
        cs = self._cs
        if FORKED_DEVICES and cs.origin.forked:  # an os.fork() child: before any copy or lock (sync.Origin)
            raise cs.origin.error("CapturedGraph.run()")
        probe = cs.capture_probe
        if probe is not None and probe():  # before any copy: CUDA calls inside a foreign capture break it
            cs.check_foreign_capture()  # raises CaptureError (ORT PR #32081)
        if out is not None or (copy_outputs is not True and copy_outputs is not False):
            copy_outputs, out = self._check_outputs_arg(copy_outputs, out)  # before any copy
        if self._many is not None:
            self._refuse_inside_many()
        guard = cs.guard
        # the guard's inline paths, below; lock_only: a session without the CUDA gate (the guard is its lock)
        cg, lock, lock_only = guard.inline
        while True:  # a thread without its CUDA graph of the id (new thread, or after a compaction) captures first
            # ``with cs.guard:`` inlined (two Python frames less per replay): the lock alone where the guard is just
            # that, the CUDA gate's uncontended reader path exactly as SessionGuard.__enter__/__exit__ take it, or
            # the guard's own code for every other case (slot None)
            slot = None
            if lock_only:
                lock.acquire()
            else:
                if cg is not None:
                    slot = getattr(cg.tls, "slot", None)
                    if slot is not None and not slot.depth and not cg.pending:
                        slot.depth = 1
                        slot.active = True  # publish first, then look (see CaptureGate)
                        if cg.pending:  # a writer came meanwhile: back out, and take the guard's own path
                            slot.depth, slot.active = 0, False
                            slot = None
                    else:
                        slot = None
                if slot is None:
                    guard.__enter__()
                else:
                    try:
                        lock.acquire()
                    except BaseException:
                        slot.depth, slot.active = 0, False
                        raise
            try:
                if self._released:
                    self._raise_released()
                # cs.thread_has(graph_id) inlined: off CUDA every thread may replay; on CUDA the thread's own set
                if not self._captured or not cs.per_thread or self.graph_id in (
                        getattr(cs.tls, "graphs", None) or ()):  # CaptureState's per-thread graphs
                    if not self._captured and compat.binding_c_session(self._binding) is not compat.c_session(
                            cs.session):
                        self._rebind()  # uncaptured_graph(): compact() or set_providers() replaced the C session
                    if self._frozen:  # host-read inputs: the feeds, and the buffers written outside run (replay)
                        check_frozen(self._frozen, feeds, self.inputs)
                    if feeds is not None:
                        # copy_feeds' first test inlined: one feed, the source this input was last fed (its
                        # remembered device-to-device copy); anything else (or a run to settle) takes copy_feeds
                        hit = None
                        if type(feeds) is dict and len(feeds) == 1 and not UNSETTLED:
                            for name, value in feeds.items():
                                hit = self._targets.last.get(name)  # the graph's own targets
                            if hit is not None and (hit[0]() is not value or _sync.COPY_BACKEND is not None):
                                hit = None
                        if hit is not None:
                            hit[1](value)
                        else:
                            ttargets.copy_feeds(self._targets, feeds)
                    # a seqlock for ReplayOutput readers: odd while the outputs are rewritten, even when done, so a
                    # read overlapping a replay from another thread is detected (ReplayOutput.numpy checks before and
                    # after). Feeds were copied above, before it turned odd: its own previous outputs may be fed back.
                    self._generation += 1
                    try:
                        if copy_outputs is False:  # the wrappers made before ORT's call, not after its GPU wait
                            gen = self._generation + 1  # its value once this returns
                            res = []
                            for v in self._output_list:  # ReplayOutput.__init__ inlined (its three fields)
                                r = _new(ReplayOutput)
                                r.fixed_buffer = v
                                r.graph = self
                                r.generation = gen
                                res.append(r)
                        count = self._replay_count
                        if count is not None:  # ORT's call and the replay count, no frame of ours between
                            self._replay_run()
                            count.replays += 1
                        else:
                            self._replay()
                        if self._state:
                            tcopy.copy(self._state_src, self._state_dst)
                        if copy_outputs is False:
                            return res
                        if out is None and copy_outputs is True and self._numpy_out and not (
                                self._pin_ok and _staging.current_tap()):  # a tap: read through the staging
                            return [tcopy.to_numpy(v) for v in self._output_list]
                        return self._host_outputs(copy_outputs, out)
                    finally:
                        self._generation += 1
            except BaseException:
                self.settle_queued()  # a feed copy queued ahead of a replay that failed: not left in flight
                raise
            finally:
                if lock_only:
                    lock.release()
                elif slot is None:
                    guard.__exit__(None, None, None)
                else:
                    lock.release()
                    slot.depth = 0
                    slot.active = False
                    if cg.pending:
                        with cg.cond:
                            cg.cond.notify_all()
            self._capture_for_thread()  # this thread has no CUDA graph of the id

    # -- host staging ---------------------------------------------------------------------------------------
    @property
    def host_inputs(self) -> dict[str, np.ndarray]:
        """``{input name: numpy array}``: the graph's own host buffer of each input (its shape and dtype;
        page-locked on CUDA with cuda-python — :attr:`host_staging`). Fill them in place and feed them, as torch's
        ``pin_memory``: ``g.host_inputs["images"][...] = batch; g.run(g.host_inputs)`` sends each with one
        asynchronous host-to-device copy, no host copy (made on first use; they live as long as the graph or an
        array viewing them). Do not write one while a ``run_many()`` of this graph is running.

        Raises:
            GraphReleasedError: after ``release()``.
        """
        return self._live_staging().host_inputs

    @property
    def host_outputs(self) -> dict[str, np.ndarray]:
        """``{output name: numpy array}``: the graph's own host buffer of each output, what ``copy_outputs="pinned"``
        returns and a valid ``out=`` target (overwritten by every replay that returns host outputs).

        Raises:
            GraphReleasedError: after ``release()``.
        """
        return self._live_staging().host_outputs

    def _live_staging(self):
        """The graph's host staging (made on first use), under the session guard; ``GraphReleasedError`` after
        ``release()``."""
        with self._cs.guard:
            if self._released:
                self._raise_released()
            return self.staging_now()

    @property
    def host_staging(self) -> str:
        """``"pinned"`` (CUDA with cuda-python: page-locked buffers, asynchronous copies on the graph's own stream)
        or ``"pageable"`` (WebGPU, CPU, no cuda-python, ``ORTCAPTURE_PINNED=0``, or page-locked memory refused):
        how :attr:`host_inputs` / :attr:`host_outputs` are (or will be) held."""
        st = self._staging
        if st is not None:
            return st.kind
        return "pinned" if self._pin_ok else "pageable"

    def staging_now(self):
        """The graph's :class:`ortcapture._transfer.staging.HostStaging`, made on first use (:attr:`host_inputs` for
        users). The caller holds the session guard.

        :meta private:"""
        st = self._staging
        if st is None:
            st = self._staging = _staging.HostStaging(self.inputs, self.outputs, pinned=self._pin_ok)
            self._targets.staging = st
            self._numpy_out = self._numpy_out and not st.pinned
        return st

    # -- streams of requests ------------------------------------------------------------------------------------
    @property
    def copies(self) -> int:
        """Buffer sets :meth:`run_many` alternates between (``capture(..., copies=N)``; 1 by default)."""
        return 1 + len(self._copies)

    def attach_copies(self, graphs) -> None:
        """Take ``graphs`` (captured like this one, same session and shapes) as :meth:`run_many`'s further buffer
        sets; they are released with this graph (``InferenceSession.capture(..., copies=N)`` calls this)."""
        self._copies = list(graphs)

    def run_many(self, requests, *, copy_outputs: bool | str = True):
        """Run a stream of requests; yield each one's outputs, in order (an iterator).

        Args:
            requests: an iterable of feeds mappings, each as :meth:`run` takes them. With ``copies > 1`` every
                request feeds every input (the buffer sets alternate, so an input left out would keep another
                request's value).
            copy_outputs: True: new numpy arrays per request; ``"pinned"``: the graph's own :attr:`host_outputs`
                arrays of the buffer set that ran it, valid until the iterator is advanced again.

        On CUDA with page-locked staging (:attr:`host_staging` ``"pinned"``) requests overlap: while request n
        replays, a helper thread copies request n+1's numpy feeds into the page-locked buffers and — with
        ``copies >= 2`` (``capture(..., copies=2)``: a second graph with its own device buffers) — queues their
        host-to-device copies on that set's own stream, so the copy runs on the copy engine during the replay
        (events order every refill after the copy before it); request n-1's outputs are copied out of the
        page-locked buffers meanwhile. Requests are therefore read one ahead and results come one behind. The
        iterator holds the session's guard from its first item to its end (other threads' runs of the session, and
        captures, wait; a run of these graphs from the iterating thread inside the loop raises): finish or
        ``close()`` it. Elsewhere it is one :meth:`run` per request.

        Raises:
            TransferError: ``copy_outputs`` other than True or ``"pinned"`` (at the call); a request that does not
                fit (when it is reached; the requests before it were run and yielded, the later ones are not run).
            GraphReleasedError, CaptureError: as :meth:`run`.
        """
        if copy_outputs is not True and copy_outputs != "pinned":
            raise TransferError(f"run_many's copy_outputs must be True or 'pinned', got {copy_outputs!r}")
        if FORKED_DEVICES:  # an os.fork() child: at the call, not at the first item (ortcapture._ort.sync.Origin)
            self._cs.origin.check("CapturedGraph.run_many()")
        return _many.many_iter(self, iter(requests), [self, *self._copies], copy_outputs)

    # methods defined in ortcapture._core.many: a graph's own steps of run_many (the stream calls each graph of it
    # through them), the wait for queued feed copies
    _refuse_inside_many = _many.refuse_inside_many
    ensure_thread = _many.ensure_thread
    many_begin, many_feed, many_replay, many_end = _many.many_begin, _many.many_feed, _many.many_replay, _many.many_end
    settle_queued = _many.settle_queued
    feed_rows, read_rows = _rows.feed_rows, _rows.read_rows  # a request's rows (buckets): ortcapture._core.rows

    def _capture_for_thread(self) -> None:
        """Capture this graph's id in the calling thread (outside the guard; the capture guard instead). The thread's
        capture rewrites the outputs: earlier ReplayOutputs go stale."""
        cs = self._cs
        with cs.capture_guard:
            self._generation += 1
            try:
                cs.ensure_thread(self._binding, self.graph_id, self._run_options)
            finally:
                self._generation += 1

    def replay(self) -> None:
        """Replay the graph on its fixed buffers as they are now (no feeds copied, outputs left in :attr:`outputs`,
        declared state carried). For callers that fill :attr:`inputs` themselves (``ortcapture.update_inplace``) and
        read :attr:`outputs` (``ortcapture.to_numpy``). Raises like :meth:`run`."""
        self.run(None, copy_outputs=False)

    def reset_state(self, values: Mapping[str, Any] | None = None) -> None:
        """Restore the state inputs to their values at capture, or to ``values``.

        Args:
            values: ``{state input name: value}`` (as :meth:`run`'s feeds); state inputs not named are restored to
                their capture-time values.

        Raises:
            CaptureError: the graph has no declared state, or a name is not a state input.
            TransferError: a value that does not match its buffer (nothing is changed then).
            GraphReleasedError: after ``release()``.
        """
        if values is not None and not isinstance(values, Mapping):
            raise TransferError(f"values must be a mapping {{input name: value}}, got {type(values).__name__}")
        with self._cs.guard:
            if self._released:
                self._raise_released()
            if not self._state:
                raise CaptureError("this graph has no declared state (capture(..., state={out: in}))")
            values = dict(values or {})
            for name in values:
                if name not in self._initial_state:
                    raise CaptureError(f"{name!r} is not a state input ({list(self._initial_state)})")
            ttargets.copy_feeds({n: self.inputs[n] for n in values}, values)  # all checked before any change
            rest = [n for n in self._initial_state if n not in values]
            tcopy.copy([self._initial_state[n] for n in rest], [self.inputs[n] for n in rest])

    @property
    def state_inputs(self) -> list[str]:
        """The inputs carried with ``state=`` (in declaration order)."""
        return list(self._state.values()) if hasattr(self, "_state") else []

    @property
    def frozen_inputs(self) -> dict:
        """``{input name: numpy value}`` of the inputs ORT reads in host memory: capture-time constants, checked
        on every :meth:`run` that feeds them (set by ``InferenceSession.capture``)."""
        return dict(self._frozen)

    def freeze_inputs(self, values: Mapping[str, Any]) -> None:
        """Record host-read inputs' capture-time values (``InferenceSession.capture`` calls this)."""
        self._frozen = {n: np.array(v, copy=True) for n, v in values.items()}

    # -- lifetime -------------------------------------------------------------------------------------------
    @property
    def session(self):
        """The :class:`~ortcapture.InferenceSession` that holds this graph: the session
        :meth:`~ortcapture.InferenceSession.capture` was called on, or its shape-specialised sibling (see ``capture_deferred``)."""
        return self._cs.session

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ran (explicitly, at the end of a ``with`` block, or when the graph was
        collected): its ``gpu_graph_id`` is retired and every later run raises :class:`GraphReleasedError`."""
        return self._released

    @property
    def generation(self) -> int:
        """The outputs' seqlock counter (even while the outputs are stable, odd while a replay rewrites them); each
        :class:`ReplayOutput` remembers the value it was made at."""
        return self._generation

    @property
    def replays(self) -> int:
        """Replays of the captured graph so far (the capturing call itself not counted)."""
        return self._record.replays if self._record is not None else 0

    def uncount_replays(self, n: int) -> None:
        """Take ``n`` internal replays (capture-time verification) out of :attr:`replays`."""
        if self._record is not None:
            self._record.replays -= n

    def release(self) -> None:
        """Release the captured graph (idempotent, thread-safe). CUDA/TensorRT: the ``gpu_graph_id`` is retired.
        The graph's buffers are freed once no :class:`ReplayOutput` or other reference holds them.

        In an ``os.fork()`` child of the process that captured it, the graph is only marked released: ORT's release
        and the buffers' free would reach the parent's device state, which does not survive fork (a hang)."""
        copies, self._copies = self._copies, []
        for twin in copies:
            twin.release()
        if FORKED_DEVICES and self._cs.origin.forked:
            self._released = True
            return
        with self._cs.guard:  # two concurrent releases must not release a graph re-captured under the id
            if self._released:
                return
            pinned = self._staging is not None and self._staging.pinned
            if self._captured:
                self._cs.release(self.graph_id)  # ends in detach()
            self.detach()
            if pinned:  # its page-locked buffers (unless an array still views them), stream and events
                _staging.free_released_staging()
        if self._captured:
            _compact.maybe_compact(self._cs.family)  # outside the guard: it takes the capture guard

    # -- compaction (InferenceSession.compact, ortcapture._memory.compact) ----------------------------------------------
    def snapshot(self, everything: bool = False) -> dict:
        """Host copies of the outputs (and with ``everything``, of the inputs and initial state too), taken before the
        C session is rebuilt: ``{"outputs"|"inputs"|"initial_state": {name: numpy array}}``."""
        groups = {"outputs": self.outputs}
        if everything:
            groups.update(inputs=self.inputs, initial_state=self._initial_state)
        return {k: {n: tcopy.to_numpy(v) for n, v in d.items()} for k, d in groups.items()}

    def recapture(self, saved: dict, move: bool = False) -> None:
        """Capture this graph again on its session's rebuilt C session, side-effect free: a new IOBinding of the same
        buffers (so ``inputs``/``outputs`` references a caller holds stay valid), the capture, then the outputs
        restored from ``saved`` (:meth:`snapshot`). ``move``: where ORT refuses the old buffers for the new C session
        (a session-scoped WebGPU OrtValue is bound only to a session on its WebGPU context; ORT 1.31/1.32 accept the
        rebuilt one), new buffers from the new C session's allocator, filled from ``saved`` (which must then hold
        ``inputs`` and ``initial_state`` too). :class:`ReplayOutput` s handed out before go stale. The caller holds
        the capture guard."""
        cs = self._cs
        self._generation += 1
        try:
            try:
                self._rebind()
            except ValueError:  # ORT: "Session-scoped OrtValue must be bound to the session that created it"
                if not move:
                    raise
                for key, bufs in (("inputs", self.inputs), ("outputs", self.outputs),
                                  ("initial_state", self._initial_state)):
                    for name, old in list(bufs.items()):
                        bufs[name] = cs.new_buffer(old.shape(), tcheck.np_dtype_of(old))
                    tcopy.restore(bufs, saved[key])  # the values they held: no input rule applies again
                self._rebind()
            replays = self._record.replays if self._record is not None else 0
            self._record = cs.capture(self._binding, self.graph_id, self._run_options, owner=self)
            self._record.replays = replays
            self._plan()
            tcopy.restore(self.outputs, saved["outputs"])
        finally:
            self._generation += 1

    def _rebind(self) -> None:
        """A new IOBinding of the fixed buffers on the session's current C session (after a compaction or
        ``set_providers``), and the lists derived from the buffers."""
        session = self._cs.session
        binding = IOBinding(session)
        for name, buf in self.inputs.items():
            binding.bind_ortvalue_input(name, buf)
        for name, buf in self.outputs.items():
            binding.bind_ortvalue_output(name, buf)
        self._binding = binding
        self._state_src = [self.outputs[o] for o in self._state]
        self._state_dst = [self.inputs[i] for i in self._state.values()]
        # one entry per get_outputs() entry: a value listed twice as a graph output is one buffer at each position
        self._output_list = [self.outputs[m.name] for m in session.get_outputs()]
        self._output_names = [m.name for m in session.get_outputs()]
        self._plan()

    def _plan(self) -> None:
        """Decide what every replay does, once: at capture and again whenever something it depends on changes (a
        new binding or record: compaction, ``set_providers`` for an uncaptured graph, a re-capture; new buffers).
        The replay then runs the plan: the feed copies (:class:`ortcapture.transfer.FeedTargets`: sources checked
        before are copied straight through ORT), ORT's one call with the count (``CaptureState.replayer``), the
        outputs (host staging where the device is CUDA with cuda-python), and — where the session's CUDA compute
        stream is known (``CaptureState.compute_stream``) — remembered device-to-device feeds queued on it ahead of
        the replay instead of a synchronous copy each. What stays per call, because it can
        change between any two calls: the foreign-capture probe (another library may begin a capture at any
        time), the guard (gate and session lock: ~0.3 µs uncontended), the released flag, the calling thread's
        graph (a thread may be new), host-read input values, and each feed's identity and attributes."""
        cs = self._cs
        st = getattr(self, "_staging", None)
        if st is not None and (any(st.inputs.get(n) is not b for n, b in self.inputs.items())
                               or any(st.outputs.get(n) is not b for n, b in self.outputs.items())):
            st = None  # new buffers (a compaction that had to move them): new staging, made when next needed
        self._staging = st
        gate = cs.guard.holds_cuda_gate
        where = self._device.device_type if self._device is not None else None
        #: host data in and out can go through pinned staging: CUDA buffers, a CUDA session's guard, cuda-python
        self._pin_ok = bool(gate and where == "cuda" and _sync.PINNED and compat.has_cuda_python())
        #: ... and plain numpy feeds and copy_outputs=True take it unasked where the inputs and outputs hold
        #: _sync.PINNED_AUTO_MIN bytes ($ORTCAPTURE_PINNED_MIN, default 1 MiB; None: never unasked); otherwise
        #: nothing is pinned until host_inputs, host_outputs, copy_outputs="pinned", out= or run_many ask for it
        io_bytes = sum(meta(v).nbytes for v in (*self.inputs.values(), *self.outputs.values()))
        self._stage_auto = self._pin_ok and _sync.PINNED_AUTO_MIN is not None and io_bytes >= _sync.PINNED_AUTO_MIN
        #: copy_outputs=True reads each output with ORT's own copy (no page-locked staging to read through)
        self._numpy_out = not self._stage_auto and (st is None or not st.pinned)
        ref = weakref.ref(self)
        factory = (lambda: ref().staging_now()) if self._stage_auto else None  # weak: no graph <-> targets cycle
        # the session's CUDA compute stream where it is known (ortcapture's own): remembered device-to-device feeds
        # are then queued on it ahead of the replay instead of waiting for each copy
        stream = cs.compute_stream() if gate and where == "cuda" and cs.compute_stream is not None else None
        self._targets = ttargets.FeedTargets(self.inputs, gate, st, factory, stream, cs.lock)
        self._replay = cs.replayer(self._binding, self._run_options, self._record) if self._record is not None \
            else None
        #: the replay with nothing to add to ORT's call but the count (no host-read inputs to check, no queue
        #: drains): run() calls ORT's bound run itself and counts into this record; else None (run() calls _replay)
        self._replay_run, self._replay_count = cs.replay_parts(self._binding, self._run_options, self._record) \
            if self._record is not None else (None, None)

    def detach(self) -> None:
        """Called by the session when the graph is gone (:meth:`release`, ``release_captured_graph``,
        ``set_providers``): the graph is marked released and lets go of its binding and buffers. Idempotent; users
        call :meth:`release`."""
        if self._released:
            return
        self._released = True
        self._drop_buffers()

    def _drop_buffers(self) -> None:
        self._binding = None
        self._targets = None
        self._replay = None
        self._replay_run = self._replay_count = None
        staging = getattr(self, "_staging", None)  # None too when a failed capture() drops what it made so far
        if staging is not None and staging.pinned:  # the callers' arrays it page-locked: queued (no CUDA call
            staging.unregister_in_place()  # here), done by release() or the next safe point
        self._staging = None
        self._state_src = self._state_dst = []
        for d in ("inputs", "outputs", "_initial_state"):
            if hasattr(self, d):
                setattr(self, d, {})
        self._output_list = []

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
        info = self._cs.info
        ep = info.ep.name if info is not None and self._captured else "not captured"
        return f"<CapturedGraph gpu_graph_id={self.graph_id} {ep} {state}>"


class _NotCaptured:
    """The registry record's stand-in for a graph built with ``_without_capture``: it only counts runs."""

    __slots__ = ("replays", "frozen", "outputs")

    def __init__(self) -> None:
        # as CapturedGraphRecord's: nothing bound with bind_cpu_input; nothing pinned (the binding's outputs are read)
        self.replays, self.frozen, self.outputs = 0, {}, {}
