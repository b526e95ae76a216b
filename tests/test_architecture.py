"""The architecture's promises, checked: one ORT run call, one feed-copy function, ORT's classes taken at import
(ortcapture keeps working when ``onnxruntime.InferenceSession`` is replaced)."""
from __future__ import annotations

import ast
import pathlib
import sys

import numpy as np
import onnxruntime as ort
import pytest

import ortcapture
from ortcapture._transfer import targets as ttargets
from tests import tiny

_PKG = pathlib.Path(ortcapture.__file__).parent
#: every module of the library but the command line, by its path inside the package (``_core/run.py``)
CORE = sorted(p for p in _PKG.rglob("*.py") if p.relative_to(_PKG).parts[0] != "cli")


#: modules whose classes derive from ortcapture's own session: their ``super().m(...)`` calls reach ortcapture
SUBCLASSES_OF_OURS = {"dropin.py"}


def _calls(path: pathlib.Path) -> list[str]:
    """Names of every function or method called in ``path`` (``a.b.c(...)`` -> ``c``); in
    :data:`SUBCLASSES_OF_OURS`, ``super().m(...)`` calls (to ortcapture's session, which routes them) are left out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if (path.name in SUBCLASSES_OF_OURS and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Call)
                    and getattr(f.value.func, "id", "") == "super"):
                continue
            out.append(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_orts_run_with_iobinding_is_called_from_one_place_in_the_core():
    where = {p.relative_to(_PKG).as_posix(): n for p in CORE
             if (n := sum(c in ("run_with_iobinding", "ORT_RUN_WITH_IOBINDING") for c in _calls(p)))}
    assert where == {"_core/run.py": 1}, where
    # and every core path reaches ORT through it
    users = {p.relative_to(_PKG).as_posix() for p in CORE if "run_bound" in _calls(p)}
    assert {"_session/session.py", "_core/state.py", "_core/capture.py"} <= users


def test_feeds_are_copied_by_one_function(backend, rng, monkeypatch):
    graph_calls = _calls(pathlib.Path(sys.modules[ortcapture.CapturedGraph.__module__].__file__))  # _core/graph.py
    assert "copy_feeds" in graph_calls
    assert not {"update_inplace", "prepare", "commit"} & set(graph_calls)
    calls = []
    real = ttargets.copy_feeds

    def spy(buffers, feeds):
        calls.append(sorted(feeds))
        return real(buffers, feeds)

    monkeypatch.setattr(ttargets, "copy_feeds", spy)  # the implementation module: the graph calls it there
    sess = backend.session(tiny.add_model())
    a, b = rng.random((2, 4), np.float32), rng.random((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}, verify=False) as g:  # verify= copies its input sets the same way
        g.run({"A": b})
        np.testing.assert_array_equal(g.run({"A": a, "B": a})[0], 2 * a)
    assert calls == [["A", "B"], ["A"], ["A", "B"]]


def test_capture_works_with_onnxruntime_inference_session_replaced(backend, rng, monkeypatch):
    """Libraries' code creates ``onnxruntime.InferenceSession``: replaced by ortcapture's, the first capture once
    recursed until RecursionError (ortcapture looked ORT's methods up through the module at call time)."""
    monkeypatch.setattr(ort, "InferenceSession", ortcapture.InferenceSession)
    monkeypatch.setattr(ort, "IOBinding", ortcapture.IOBinding)
    sess = backend.session(tiny.add_model())
    assert isinstance(sess, ortcapture.InferenceSession)
    a, b = rng.random((2, 4), np.float32), rng.random((2, 4), np.float32)
    with sess.capture({"A": a, "B": b}) as g:
        for k in (1.0, 2.0, 3.0):
            np.testing.assert_allclose(g.run({"A": a * k})[0], a * k + b, rtol=1e-6)
        assert g.replays == 3
    # the raw IOBinding path and an uncaptured run too
    x, y = sess.allocate((2, 4), np.float32), sess.allocate((2, 4), np.float32)
    out = sess.allocate((2, 4), np.float32)
    ortcapture.update_inplace(x, a)
    ortcapture.update_inplace(y, b)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("A", x)
    binding.bind_ortvalue_input("B", y)
    binding.bind_ortvalue_output("C", out)
    sess.run_with_iobinding(binding, ortcapture.run_options_for(5))
    sess.run_with_iobinding(binding, ortcapture.run_options_for(5))
    np.testing.assert_allclose(ortcapture.to_numpy(out), a + b, rtol=1e-6)
    np.testing.assert_allclose(sess.run(None, {"A": a, "B": b}, ortcapture.run_options_for(-1))[0], a + b, rtol=1e-6)


def test_automatic_graph_ids_start_at_one(backend):
    sess = backend.session(tiny.add_model())
    feeds = {"A": np.ones((2, 4), np.float32), "B": np.ones((2, 4), np.float32)}
    with sess.capture(feeds) as g:
        assert g.graph_id == 1  # 0 is what a raw run without a gpu_graph_id entry uses


def test_public_surface_is_all():
    assert "IOBinding" in ortcapture.__all__ and "webgpu" in ortcapture.__all__
    for name in ortcapture.__all__:
        assert getattr(ortcapture, name) is not None
    assert hasattr(ortcapture.IOBinding, "declare_state")


def test_no_import_cycles_anywhere_in_the_package():
    """Every import in ``ortcapture/`` (the CLI included, imports inside functions too), as import-linter's graph
    library sees them: no module reaches itself again (issue 33)."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("ortcapture")
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert cycles == []
