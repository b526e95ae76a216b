"""``InferenceSession.capture`` and ``uncaptured_graph``: a ``CapturedGraph`` on the session (or its shape sibling).

Moved out of :mod:`ortcapture.session` unchanged. The functions are methods of
:class:`ortcapture._session.session.InferenceSession` (assigned in its class body).
"""
from __future__ import annotations

from typing import Any, Mapping

from ortcapture._core.reference import check_ep_accuracy, reference_runner, verify_graph
from ortcapture._core.run import SKIP_GRAPH_ID, check_graph_id
from ortcapture._memory import compact as _compact
from ortcapture._ort import specialize as shapes
from ortcapture._ort.providers import CaptureInfo
from ortcapture._ort.sync import FORKED_DEVICES
from ortcapture._session.setup import check_tensor_io
from ortcapture._transfer import copy as tcopy
from ortcapture._transfer.arena import suspend_tap
from ortcapture._verify.compare import level_of
from ortcapture.errors import CaptureError, CaptureUnsupportedError

#: at most this many buffer sets per capture (``copies=``): run_many overlaps one request's copy with the replay
#: before it, so 2-3 are the useful range, and each one is a whole graph with its own device buffers
MAX_COPIES = 16


def capture(self, example_feeds: Mapping[str, Any], graph_id: int | None = None, *,
            state: Mapping[str, str] | None = None, verify: Any = None, copies: int = 1):
    """Capture a graph for ``example_feeds``' shapes and dtypes and return a
    :class:`~ortcapture.graph.CapturedGraph` (see there).

    Args:
        example_feeds: ``{input name: value}`` for every model input (numpy arrays, OrtValues on any device,
            DLPack tensors); their shapes and dtypes are the graph's, their values its initial inputs.
            Overridable initializers (``get_overridable_initializers()``) fed here become inputs of the graph
            too; those not fed keep the model's value.
        graph_id: the ``gpu_graph_id``; ``None`` picks the smallest free id >= 1.
        state: ``{output name: input name}`` pairs carried from one replay to the next on the device.
        verify: ``True``/``"full"``, ``"example"``, ``False``/``"off"``; ``None``: the session's ``verify=``.
            After capture the replay of the example (and at ``"full"`` of a varied input set, host-read inputs
            kept) is compared with a reference run on the same EP — it judges the capture, not the EP: the
            graph's own session with ``gpu_graph_id=-1``, exactly; a graph on a shape-specialised sibling the
            shape-deferred base session, within ``ortcapture._verify.compare.DEFAULT_RTOL`` relative to each
            output's max. The example is then restored exactly into the inputs, the ``state=`` inputs and the
            outputs. At ``"full"`` the example is also run once per session on ORT's CPU EP: outputs
            beyond that tolerance give one :class:`~ortcapture.errors.EPAccuracyWarning` (the EP's accuracy,
            never a refusal). Cost: two replays and two reference runs at ``"full"`` (see
            benchmarks/bench_verify.py).
        copies: buffer sets for :meth:`~ortcapture.graph.CapturedGraph.run_many` (``copies=2``: a second graph
            of the same shapes under the next free id, captured and verified the same way, with its own device
            and host buffers, so the host-to-device copy of one request overlaps the replay of the one before);
            released with the returned graph. Not with ``state=``.

    Raises:
        VerificationError: (a ``CaptureError``) the replay differs from the reference (outputs named; for the
            varied set the copy-only kernels feeding them, ``nodes``); the graph is released.
        CaptureUnsupportedError: the session cannot capture, or not even with the example's shapes fixed (the
            message names the nodes ORT placed off the EP and dtypes or non-tensor inputs/outputs it cannot
            take), or an input/output is not a numeric tensor (strings, sequences, maps, optional values).
        CaptureError: ``graph_id`` taken or invalid; a refused capture (see CapturedGraph); ``copies`` not an
            int from 1 to 16 (``MAX_COPIES``), or ``copies > 1`` with ``state=``.
        GraphReleasedError: ``graph_id`` was released on CUDA/TensorRT (retired).
        TransferError: feeds that do not match the model's inputs.
        CaptureError: (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that made the session:
            ORT's device state does not survive fork (the capture would hang or crash without a word).

    Where the model has dynamic input dims and ORT refused capture for them, the graph is captured on a sibling
    session with the same model, providers and options but those dims fixed (cached per shape signature).
    """
    from ortcapture._core.graph import CapturedGraph

    if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
        self._oc_origin.check("capture()")
    if isinstance(copies, bool) or not isinstance(copies, int) or not 1 <= copies <= MAX_COPIES:
        raise CaptureError(f"copies must be an int from 1 to {MAX_COPIES}, got {copies!r} (each copy is a whole "
                           "graph with its own device buffers; run_many needs 2-3)")
    if copies > 1:
        if state:
            raise CaptureError("copies > 1 cannot carry state= (each buffer set would hold its own state)")
        graph = self.capture(example_feeds, graph_id, verify=verify)
        twins = []
        try:
            for _ in range(copies - 1):
                twins.append(self.capture(example_feeds, None, verify=verify))
        except BaseException:
            for g in (*twins, graph):
                g.release()
            raise
        graph.attach_copies(twins)
        return graph
    fam = self._oc_state
    fam.release_collected()
    _compact.maybe_compact(fam)
    with fam.guard:  # the session's metadata: never read while a compaction rebuilds the C session
        check_tensor_io(self)
    target = self._oc_specialized_for(example_feeds) if fam.deferred else fam
    if target.info is None:
        self._oc_require_capture("capture()")
    target.check_foreign_capture()
    graph = None
    try:  # any BaseException (a KeyboardInterrupt too) releases a graph made here: the next capture() works
        with fam.capture_guard:
            gid = fam.free_id() if graph_id is None else check_graph_id(graph_id)
            fam.check_free(gid)
            graph = CapturedGraph(target, example_feeds, gid, state=state)
            fam.graphs.add(graph)
            host = shapes.host_read_inputs(target.session)
        level = self._oc_verify if verify is None else level_of(verify)
        if host:
            graph.freeze_inputs({n: tcopy.to_numpy(graph.inputs[n]) for n in host})
        with suspend_tap():  # verification's reads are not the caller's answer (ortcapture.transfer.tap_device_outputs)
            if level != "off":
                reference, rtol = reference_runner(target, self._oc_args[0], self._oc_ref_cache)
                graph.verification = verify_graph(graph, level, reference, rtol, keep=host,
                                                  model_source=self._oc_args[0])
            if level == "full":  # the EP against ORT's CPU EP: reported once, never a refusal
                check_ep_accuracy(target, graph, self._oc_args[0], self._oc_ref_cache)
    except BaseException:
        if graph is not None:
            graph.release()
        raise
    return graph


def uncaptured_graph(self, example_feeds: Mapping[str, Any], device: str | None = None):
    """The same fixed buffers, IOBinding and :meth:`~ortcapture.graph.CapturedGraph.run` as :meth:`capture`, run
    with ``gpu_graph_id=-1`` (never captured, never replayed): the honest "no graph" arm of a benchmark
    (``ortcapture bench --no-graph-capture``), or a way to tell a capture problem from a model problem.

    Args:
        example_feeds: as for :meth:`capture`.
        device: where the fixed buffers live, ``"cuda:N"`` or ``"webgpu"``; default the session's capture device
            (required on a session that does not capture).

    Raises:
        CaptureUnsupportedError: no ``device`` on a session without capture.
        TransferError: feeds that do not match the model's inputs.
        CaptureError: (``kind`` ``"fork"``) in an ``os.fork()`` child of the process that made a device session,
            or fixed buffers on a device that process had in use (ORT's device state does not survive fork).
    """
    from ortcapture._ort.providers import CAPTURE_EPS
    from ortcapture._core.graph import CapturedGraph

    if FORKED_DEVICES:  # an os.fork() child: refused before any native call (ortcapture._ort.sync.Origin)
        self._oc_origin.check("uncaptured_graph()")
    st = self._oc_state
    if device is None:
        if st.device is None:
            raise CaptureUnsupportedError("uncaptured_graph() on a session without capture needs device= "
                                          "('cuda:N' or 'webgpu')")
        where = st.device
    else:
        kind, _, ordinal = str(device).partition(":")
        ep = next((e for e in CAPTURE_EPS.values() if e.device_type == kind), None)
        if ep is None:
            raise CaptureUnsupportedError(f"device {device!r}: expected 'cuda:N' or 'webgpu'")
        where = CaptureInfo(ep, int(ordinal or 0))
    with st.capture_guard:  # reads the session's metadata: not while a compaction rebuilds the C session
        return CapturedGraph(st, example_feeds, SKIP_GRAPH_ID, capture=False, device=where)
