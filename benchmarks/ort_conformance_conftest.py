"""pytest bootstrap for ``benchmarks/ort_conformance.py``: copied as ``conftest.py`` next to ORT's test files in a
temporary working directory, one pytest subprocess per install mode. Not a test module of this repository.

Configuration: the environment variable ``ORTCAPTURE_CONFORMANCE`` (JSON) with

* ``install``: ``"raw"`` (ORT untouched), ``"patch"`` (``ortcapture.patch_onnxruntime(provider=None)``: the official
  drop-in, sessions keep the providers the tests name) or ``"class"`` (``onnxruntime.InferenceSession =
  ortcapture.InferenceSession``: the plain replacement that hit RecursionError before issue 24);
* ``results``: a JSON-lines file this bootstrap appends to as tests run (a crash leaves what ran before it);
* ``hide_eps``: EP names ``onnxruntime.get_available_providers()`` leaves out (all modes alike);
* ``splits``: ``{"FILE::CLASS::METHOD": [part, ...]}``: the test method is replaced by one test per part, named
  ``METHOD__PART``; each runs the original method with the other parts' ``self.PART`` calls made no-ops, and skips
  when the method does not reach its part on this machine. The test file on disk is not changed.

It also provides ``onnx.mapping`` (removed from recent onnx) where onnx lacks it, built from onnx.helper's dtype
functions: ``TENSOR_TYPE_TO_NP_TYPE`` and ``NP_TYPE_TO_TENSOR_TYPE``.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import types
import unittest

CONFIG = json.loads(os.environ["ORTCAPTURE_CONFORMANCE"])


def _write(record: dict) -> None:
    with open(CONFIG["results"], "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def _onnx_mapping_shim() -> None:
    try:
        import onnx.mapping  # noqa: F401
        return
    except ImportError:
        pass
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    to_np, to_tensor = {}, {}
    for t in TensorProto.DataType.values():
        if t in (TensorProto.UNDEFINED, TensorProto.STRING):
            continue
        try:
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(t))
        except Exception:  # noqa: BLE001 - a type numpy cannot hold
            continue
        to_np[t] = dt
        try:
            if helper.np_dtype_to_tensor_dtype(dt) == t:  # the round trip: uint16 stays UINT16, not BFLOAT16
                to_tensor[dt] = t
        except Exception:  # noqa: BLE001
            pass
    to_np[TensorProto.STRING] = np.dtype(object)
    to_tensor[np.dtype(object)] = TensorProto.STRING
    mod = types.ModuleType("onnx.mapping", "ortcapture conformance shim for the removed onnx.mapping")
    mod.TENSOR_TYPE_TO_NP_TYPE = to_np
    mod.NP_TYPE_TO_TENSOR_TYPE = to_tensor
    sys.modules["onnx.mapping"] = mod
    onnx.mapping = mod


def _hide_eps(names: list[str]) -> None:
    """``onnxruntime.get_available_providers()`` without ``names`` (``--without-ep``: e.g. a TensorRT EP the wheel
    lists but cannot load, which sends ORT's CUDA-graph test down its TensorRT branch)."""
    import onnxruntime

    listed = onnxruntime.get_available_providers

    def get_available_providers():
        return [p for p in listed() if p not in names]

    onnxruntime.get_available_providers = get_available_providers


def _install(mode: str) -> None:
    import onnxruntime

    if mode == "patch":
        import ortcapture

        ortcapture.patch_onnxruntime(provider=None)
    elif mode == "class":
        import ortcapture

        onnxruntime.InferenceSession = ortcapture.InferenceSession
    elif mode != "raw":
        raise ValueError(f"unknown install mode {mode!r}")
    cls = onnxruntime.InferenceSession
    info = {"install": mode, "session_class": f"{cls.__module__}.{cls.__qualname__}",
            "onnxruntime": onnxruntime.__version__, "providers": onnxruntime.get_available_providers(),
            "hidden_eps": CONFIG.get("hide_eps", [])}
    if mode != "raw":
        import ortcapture

        info["ortcapture"] = ortcapture.__version__
        info["ortcapture_file"] = ortcapture.__file__
    _write({"meta": info})


_CURRENT: list[str] = [""]  # the running test's node id
_SUBTEST = unittest.TestCase.subTest


@contextlib.contextmanager
def _counted_subtest(self, *args, **kwargs):
    """unittest's ``subTest``, recording how each one ended: pytest reports failed and skipped subtests but not
    passed ones, and a test whose every subtest skipped must count as skipped, not passed."""
    with _SUBTEST(self, *args, **kwargs):
        try:
            yield
        except unittest.SkipTest:
            _write({"subtest_end": _CURRENT[0], "outcome": "skipped"})
            raise
        except BaseException:
            _write({"subtest_end": _CURRENT[0], "outcome": "failed"})
            raise
        _write({"subtest_end": _CURRENT[0], "outcome": "passed"})


unittest.TestCase.subTest = _counted_subtest
_onnx_mapping_shim()
if CONFIG.get("hide_eps"):
    _hide_eps(CONFIG["hide_eps"])
_install(CONFIG["install"])


def split_method(cls: type, method: str, parts: list[str]) -> list[str]:
    """Replace ``cls.method`` by one test method per part (see the module docstring); returns their names."""
    original = vars(cls)[method]
    names = []
    for part in parts:
        def case(self, _part=part):
            reached = []
            target = getattr(self, _part)

            def tracked(*args, **kwargs):
                reached.append(True)
                return target(*args, **kwargs)

            for other in parts:  # instance attributes shadow the class's methods for this test only
                setattr(self, other, tracked if other == _part else (lambda *a, **k: None))
            original(self)
            if not reached:
                self.skipTest(f"{method} does not reach {_part} on this machine")

        case.__name__ = case.__qualname__ = f"{method}__{part}"
        case.__doc__ = f"{method}, only its {part}(...) part (the other parts are no-ops)"
        setattr(cls, case.__name__, case)
        names.append(case.__name__)
    delattr(cls, method)
    return names


def pytest_pycollect_makeitem(collector, name, obj):
    if isinstance(obj, type):
        for target, parts in CONFIG.get("splits", {}).items():
            file, cls_name, method = target.split("::")
            if collector.path.name == file and name == cls_name and method in vars(obj):
                split_method(obj, method, list(parts))
    return None  # default collection goes on, on the changed class


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _CURRENT[0] = nodeid
    _write({"started": nodeid})


def pytest_runtest_logreport(report):
    message = ""
    if report.outcome != "passed":
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message
        elif isinstance(report.longrepr, tuple):  # skips: (file, line, reason)
            message = str(report.longrepr[-1])
        else:
            lines = str(report.longrepr or "").strip().splitlines()
            message = lines[-1] if lines else ""
    _write({"id": report.nodeid, "when": report.when, "outcome": report.outcome,
            "subtest": type(report).__name__ != "TestReport", "message": message[:300]})
