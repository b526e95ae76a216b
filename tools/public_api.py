"""The public API that the reference documents and the docstring-coverage check covers: ``ortcapture.__all__``,
``ortcapture.webgpu``, ``ortcapture.dropin`` and ``ortcapture.serving`` (where it exists).

``python tools/public_api.py`` prints the source files that define it, one a line (the paths interrogate checks in
``tools/docs.sh``); ``docs/conf.py`` uses :func:`surface` to fail the build on a public name the reference leaves out.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: optional dependencies that public modules import at import time (ortcapture.serving.deployment imports Ray):
#: mocked while the surface is read, as in the docs build (``autodoc_mock_imports``); never needed installed
OPTIONAL = ["ray"]
#: public module -> ``"__all__"`` (its exported names) or ``None`` (every public function and class defined in it)
PUBLIC = {"ortcapture": "__all__", "ortcapture.webgpu": "__all__", "ortcapture.dropin": "__all__",
          "ortcapture.serving": "__all__"}


def _modules():
    for name, attr in PUBLIC.items():
        try:
            yield name, attr, importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise  # a missing dependency is an error, a module not on this branch is not


def surface() -> dict[str, object]:
    """``{dotted public name: object}``: every name a user can import from the public modules (modules included).

    Names whose modules import an :data:`OPTIONAL` dependency resolve with it mocked (Sphinx's autodoc mock)."""
    from sphinx.ext.autodoc.mock import mock

    with mock(OPTIONAL):
        return _surface()


def _surface() -> dict[str, object]:
    out = {}
    for name, attr, module in _modules():
        if attr is None:
            names = [n for n, v in vars(module).items() if not n.startswith("_")
                     and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == name]
        else:
            names = list(getattr(module, attr))
        for n in names:
            out[f"{name}.{n}"] = getattr(module, n)
    return out


def files() -> list[Path]:
    """The source files defining the public surface: each public module, and each module a public name comes from
    (a package's every module: ``ortcapture.serving``'s)."""
    paths = set()
    for name, _attr, module in _modules():
        paths.add(Path(module.__file__))
        if hasattr(module, "__path__") and name != "ortcapture":
            paths.update(Path(module.__file__).parent.rglob("*.py"))
    for value in surface().values():
        if isinstance(value, types.ModuleType):
            paths.add(Path(value.__file__))
        elif (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__.startswith("ortcapture"):
            paths.add(Path(inspect.getsourcefile(inspect.unwrap(value))))
    return sorted(p.resolve() for p in paths)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for p in files():
        print(p.relative_to(ROOT))
