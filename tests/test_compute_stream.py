"""The CUDA EP's compute stream of ortcapture's own (``ortcapture._ort.compute_stream``), without a GPU: which
sessions get one, how ORT is told, what ``get_provider_options()`` reports, the copy queued on it and its fallback,
and the release of the streams. The GPU side (the copy's order and results on the H200) is in tests/test_cuda.py."""
from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from ortcapture._ort import compute_stream as cs
from ortcapture._ort import cudart, sync

CUDA = "CUDAExecutionProvider"


@pytest.mark.parametrize("name, opts, want", [
    (CUDA, {"enable_cuda_graph": "1"}, True),
    (CUDA, {"enable_cuda_graph": "True", "device_id": "1"}, True),
    (CUDA, {"enable_cuda_graph": "0"}, False),
    (CUDA, {}, False),
    (CUDA, {"enable_cuda_graph": "1", "user_compute_stream": "140230"}, False),  # the caller's stream
    (CUDA, {"enable_cuda_graph": "1", "has_user_compute_stream": "1"}, True),  # ORT derives it from the pointer
    (CUDA, {"enable_cuda_graph": "1", "user_compute_stream": "0"}, True),
    (CUDA, {"enable_cuda_graph": "1", "user_compute_stream": "0x10"}, True),  # ORT parses decimal only
    (CUDA, {"enable_cuda_graph": "1", "gpu_external_alloc": "12345"}, False),  # ORT refuses both together
    ("TensorrtExecutionProvider", {"trt_cuda_graph_enable": "1"}, False),  # its own stream option
    ("CPUExecutionProvider", {"enable_cuda_graph": "1"}, False),
])
def test_wants_stream(name, opts, want):
    assert cs.wants_stream(name, opts) is want


class _Streams:
    """cudart.new_stream / new_event stand-ins: distinct handles per call, calls logged; ``fail`` makes them raise."""

    def __init__(self, monkeypatch):
        from ortcapture._ort import compat

        self.made: list = []
        self.fail = False
        monkeypatch.setattr(compat, "cudart", lambda: SimpleNamespace())
        monkeypatch.setattr(cudart, "new_stream", self._new("stream"))
        monkeypatch.setattr(cudart, "new_event", self._new("event"))
        self.released: list = []
        monkeypatch.setattr(cudart, "release_later", lambda kind, h: self.released.append((kind, h)))

    def _new(self, kind):
        def make(device):
            if self.fail:
                raise RuntimeError("cudaStreamCreateWithFlags failed: cudaErrorInvalidDevice")
            handle = 0x7000 + 16 * len(self.made) + int(device)
            self.made.append((kind, int(device), handle))
            return handle
        return make


def _with(entries, streams):
    names, options = [n for n, _ in entries], [o for _, o in entries]
    return cs.with_streams(names, options, streams)


def test_with_streams_gives_each_device_one_stream_and_keeps_it(monkeypatch):
    fake = _Streams(monkeypatch)
    streams: dict = {}
    entries = [(CUDA, {"enable_cuda_graph": "1"}), ("CPUExecutionProvider", {})]
    first = _with(entries, streams)
    assert first == 0x7000 and entries[0][1]["user_compute_stream"] == str(0x7000) and entries[1][1] == {}
    again = [(CUDA, {"enable_cuda_graph": "1", "device_id": "0"})]
    assert _with(again, streams) == first  # set_providers / a rebuild: the same stream
    other = [(CUDA, {"enable_cuda_graph": "1", "device_id": "1"})]
    assert _with(other, streams) == 0x7011 and streams == {0: 0x7000, 1: 0x7011}
    assert [m[0] for m in fake.made] == ["stream", "stream"]
    theirs = [(CUDA, {"enable_cuda_graph": "1", "user_compute_stream": "999"})]
    assert _with(theirs, streams) is None and theirs[0][1]["user_compute_stream"] == "999"


def test_with_streams_leaves_ort_its_own_stream_where_none_can_be_made(monkeypatch):
    fake = _Streams(monkeypatch)
    fake.fail = True
    entries = [(CUDA, {"enable_cuda_graph": "1"})]
    assert _with(entries, {}) is None and "user_compute_stream" not in entries[0][1]
    fake.fail = False
    for bad in ("x", "-1", "1.0"):  # a malformed device_id: no stream made, ORT says what is wrong with it
        assert _with([(CUDA, {"enable_cuda_graph": "1", "device_id": bad})], {}) is None
    assert fake.made == []
    monkeypatch.setattr(sync, "COMPUTE_STREAM", False)  # ORTCAPTURE_COMPUTE_STREAM=0
    assert _with(entries, {}) is None and "user_compute_stream" not in entries[0][1]
    monkeypatch.setattr(sync, "COMPUTE_STREAM", True)
    from ortcapture._ort import compat

    monkeypatch.setattr(compat, "cudart", lambda: None)  # no cuda-python
    assert _with(entries, {}) is None and "user_compute_stream" not in entries[0][1]


@pytest.mark.parametrize("providers, options", [
    ([(CUDA, {"enable_cuda_graph": "1"})], [{}]),  # options in both places
    ([CUDA, "CPUExecutionProvider"], [{"enable_cuda_graph": "1"}]),  # lengths differ
    ([CUDA], ["enable_cuda_graph=1"]),  # options not a dict
])
def test_providers_for_keeps_orts_argument_checks(monkeypatch, providers, options):
    """What ORT's constructor refuses is refused alike where ortcapture gives a stream (ORT's own check)."""
    _Streams(monkeypatch)
    ss = cs.SessionStreams(object.__new__(type("Owner", (), {})))
    with pytest.raises(ValueError):
        ss.providers_for(providers, options)


def test_session_streams_build_options_for_ort_and_release_the_streams_with_the_last_holder(monkeypatch):
    fake = _Streams(monkeypatch)

    class Owner:
        pass

    class CSession:  # stands in for the C session, which an IOBinding may keep alive after the session object
        pass

    owner = Owner()
    ss = cs.SessionStreams(owner)
    plain = ["CPUExecutionProvider"]
    assert ss.providers_for(plain, None) == (plain, None, None)  # untouched: the caller's objects
    given_opts = [{"enable_cuda_graph": 1}]
    providers, options, stream = ss.providers_for([CUDA, "CPUExecutionProvider"], given_opts + [{}])
    assert providers == [CUDA, "CPUExecutionProvider"] and options[0]["user_compute_stream"] == str(0x7000)
    assert options[0]["enable_cuda_graph"] == "1"  # ORT's normalised form: string values
    assert given_opts == [{"enable_cuda_graph": 1}]  # the caller's dicts are not changed
    assert stream == 0x7000 and ss.given is None  # recorded once ORT has built the session
    tupled = ss.providers_for([(CUDA, {"enable_cuda_graph": "1", "device_id": "0"})], None)
    assert tupled[0] == [CUDA] and tupled[1][0]["user_compute_stream"] == str(0x7000) and tupled[2] == 0x7000
    c1 = CSession()
    ss.built(c1, stream)
    assert ss.given == 0x7000
    reported = {CUDA: {"device_id": "0", "user_compute_stream": str(0x7000), "has_user_compute_stream": "1"},
                "CPUExecutionProvider": {}}
    assert ss.current(reported) == (0x7000, 0x7010, 0)  # the event made on first use, then kept
    assert ss.current(reported) == (0x7000, 0x7010, 0)
    assert ss.current({CUDA: {"device_id": "0", "user_compute_stream": "0"}}) is None  # ORT's own stream
    assert ss.current(None) is None  # no C session (a failed rebuild)
    hidden = cs.hide(reported, ss.given)
    assert hidden[CUDA]["user_compute_stream"] == "0" and hidden[CUDA]["has_user_compute_stream"] == "0"
    assert reported[CUDA]["user_compute_stream"] == str(0x7000)  # ORT's report itself is not changed
    theirs = {CUDA: {"user_compute_stream": "4242"}}
    assert cs.hide(theirs, ss.given) is theirs and cs.stream_of(theirs) == 4242  # the caller's stream: shown
    assert cs.hide(None, ss.given) is None and cs.stream_of(None) is None
    # the same session built again without capture: nothing of ours is handed to ORT, nothing is hidden
    assert ss.providers_for([(CUDA, {"enable_cuda_graph": "0"})], None) == ([(CUDA, {"enable_cuda_graph": "0"})],
                                                                           None, None)
    c2 = CSession()
    ss.built(c2, None)
    assert ss.given is None
    del owner, c2
    gc.collect()
    assert fake.released == []  # c1 still holds the stream (an IOBinding of it may still run)
    del c1
    gc.collect()
    assert sorted(fake.released) == [("event", 0x7010), ("stream", 0x7000)]


def test_single_cuda_ep():
    assert cs.single_cuda_ep([CUDA, "CPUExecutionProvider"]) and cs.single_cuda_ep([CUDA])
    assert not cs.single_cuda_ep(["TensorrtExecutionProvider", CUDA, "CPUExecutionProvider"])
    assert not cs.single_cuda_ep(["CPUExecutionProvider"]) and not cs.single_cuda_ep([])


class _Rt:
    """cuda-python runtime stand-in for async_copier: each call logged; ``fail`` names the one that errs."""

    cudaStreamLegacy = 1
    cudaStream_t = int

    class cudaMemcpyKind:  # noqa: N801 - cuda-python's name
        cudaMemcpyDeviceToDevice = 3

    def __init__(self):
        self.calls: list = []
        self.fail = None

    def _call(self, name, *args):
        self.calls.append((name, *args))
        return (700 if self.fail == name else 0,)

    def cudaEventRecord(self, event, stream):  # noqa: N802
        return self._call("record", event, stream)

    def cudaStreamWaitEvent(self, stream, event, flags):  # noqa: N802
        return self._call("wait", stream, event, flags)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):  # noqa: N802
        return self._call("memcpy", dst, src, n, kind, stream)

    def cudaGetLastError(self):  # noqa: N802
        self.calls.append(("clear",))


@pytest.mark.parametrize("fail", [None, "record", "wait", "memcpy"])
def test_async_copier_queues_after_the_legacy_stream_and_falls_back_to_orts_copy(monkeypatch, fail):
    from ortcapture._ort import compat

    rt = _Rt()
    rt.fail = fail
    monkeypatch.setattr(compat, "cudart", lambda: rt)
    fell_back: list = []
    before = cs.FALLBACKS[0]
    copy = cs.async_copier(0xD000, 0x5000, 256, 0x7000, "ev", fell_back.append)
    copy("src")
    queued = [("record", "ev", 1), ("wait", 0x7000, "ev", 0), ("memcpy", 0xD000, 0x5000, 256, 3, 0x7000)]
    if fail is None:
        assert rt.calls == queued and fell_back == [] and cs.FALLBACKS[0] == before
    else:
        upto = [c[0] for c in queued].index(fail) + 1
        assert rt.calls == queued[:upto] + [("clear",)]  # the error cleared for ORT's cudaGetLastError checks
        assert fell_back == ["src"] and cs.FALLBACKS[0] == before + 1  # ORT's synchronous copy instead, counted


def test_feed_targets_remember_two_sources_per_input(monkeypatch):
    """Double-buffered feeds (two OrtValues fed in turn) both stay remembered: each is copied by its own remembered
    copy after its first checked one; a third source pushes the oldest out; COPY_BACKEND set checks every copy."""
    import numpy as np
    import onnxruntime as ort

    from ortcapture._transfer import targets as ttargets

    dst = ort.OrtValue.ortvalue_from_numpy(np.zeros(4, np.float32))
    targets = ttargets.FeedTargets({"X": dst})
    copied: list = []
    monkeypatch.setattr(ttargets, "_direct_copier", lambda d, s, g, st=None, w=False: (lambda v, s=s: copied.append(s)))
    checked: list = []
    real = ttargets.update_inplace
    monkeypatch.setattr(ttargets, "update_inplace", lambda d, v: checked.append(v) or real(d, v))
    a, b, c = (ort.OrtValue.ortvalue_from_numpy(np.full(4, v, np.float32)) for v in (1, 2, 3))
    for v in (a, b, a, b, a):
        targets.copy({"X": v})
    assert checked == [a, b] and copied == [a, b, a]
    targets.copy({"X": c})  # a third source: b (fed before a) is pushed out, a stays remembered
    targets.copy({"X": a})
    targets.copy({"X": b})
    assert checked == [a, b, c, b] and copied == [a, b, a, a]
    monkeypatch.setattr(sync, "COPY_BACKEND", "cuda-python")
    targets.copy({"X": b})
    assert checked[-1] is b and len(checked) == 5
