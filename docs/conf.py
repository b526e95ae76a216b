"""Sphinx configuration of ortcapture's documentation: the guides (Markdown, MyST) and the API reference (autodoc).

Built by ``tools/docs.sh`` with ``-W -n`` (warnings are errors, every cross-reference must resolve). Why Sphinx and
how private-module references are handled: docs/ARCHITECTURE.md, "Documentation".
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]  # the checkout (also without an editable install), public_api

import ortcapture  # noqa: E402

project = "ortcapture"
author = "ortcapture contributors"
release = version = ortcapture.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser", "sphinxarg.ext"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"  # Sphinx's own: no theme dependency
html_theme_options = {"description": "Safe, fast GPU graph capture for ONNX Runtime", "page_width": "1100px"}
myst_heading_anchors = 3  # GitHub's heading anchors (README and guides link to "#code-you-dont-control")
# guides link files outside docs/ (../benchmarks/README.md), which Sphinx cannot resolve: left as text here, and every
# local link of the guides (files and heading anchors) is checked by tests/test_docs.py instead
suppress_warnings = ["myst.xref_missing"]
smartquotes_action = "qe"  # quotes and ellipses only: "--batch" in the commands' help stays two hyphens

# Google-style docstrings (Args:/Returns:/Raises:) with reST roles
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "description"  # annotations are strings (PEP 563): shown beside the argument descriptions
autodoc_typehints_format = "short"
autodoc_typehints_description_target = "documented"  # only documented arguments (no private _oc_* ones)
autoclass_content = "both"  # a class's docstring and its __init__'s (the constructor's arguments)
# optional dependencies of modules the reference imports (the serving deployment imports Ray lazily)
import public_api  # noqa: E402  (tools/public_api.py)

autodoc_mock_imports = public_api.OPTIONAL

# -n: every cross-reference must resolve, except these (no intersphinx: CI reaches no documentation sites)
nitpicky = True
nitpick_ignore_regex = [
    # private modules (``_``-prefixed) are left out of the reference on purpose: docstrings name them for the
    # reader of the source (help(), the module map), not as links
    (r"py:.*", r"ortcapture\.(?:.*\.)?_[a-z].*"),
    # the command line's modules are documented as commands (reference/cli), not as Python API
    (r"py:.*", r"ortcapture\.cli(\..*)?"),
    # other projects' objects: onnxruntime, numpy, the standard library, typing
    (r"py:.*", r"(onnxruntime|ort|np|numpy|ml_dtypes|torch|cupy|ray|onnx)(\..*)?"),
    (r"py:.*", r"(%s)(\..*)?" % "|".join(sorted(sys.stdlib_module_names))),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Optional|Union|Path|OrtValue|IOBinding)"),
    (r"py:(class|exc|obj)", r"(ValueError|RuntimeError|TypeError|KeyError|IndexError|OSError|UserWarning|"
                            r"DeprecationWarning|RuntimeWarning|ModuleNotFoundError|Exception|BaseException|"
                            r"TimeoutError|int|float|str|bytes|bool|dict|list|tuple|set|object|None|type|"
                            r"callable|optional)"),
]


def _canonical(target: str, documented) -> str | None:
    """The documented name of a reference's ``target``, or ``None``.

    A module path of a public name resolves to the name the reference documents (``ortcapture.graph.CapturedGraph.run``
    and ``ortcapture._core.binding.IOBinding`` are documented as ``ortcapture.CapturedGraph.run`` and
    ``ortcapture.IOBinding``: ``ortcapture.__all__`` re-exports them); a bare name written in another module's
    docstring (``AutoCaptureSession`` in ``patch_onnxruntime``'s) resolves to the one documented object of that name.
    """
    parts = target.split(".")
    if parts[0] == "ortcapture":
        for i in range(1, len(parts)):
            candidate = ".".join(["ortcapture", *parts[i:]])
            if candidate in documented:
                return candidate
        return None
    # aliases (autodoc's ``:canonical:`` names, e.g. ortcapture.errors.CaptureError) are the same objects
    matches = [name for name, entry in documented.items() if name.endswith("." + target)
               and not getattr(entry, "aliased", False)]
    return matches[0] if len(matches) == 1 else None


def _resolve_facade_names(app, env, node, contnode):
    """``missing-reference``: resolve a reference through :func:`_canonical` (Python domain only)."""
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    canonical = _canonical(node["reftarget"], domain.objects)
    if canonical is None:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], canonical, node, contnode)


def _check_public_surface(app, env):
    """``env-check-consistency``: a warning (an error under -W) for every public name the reference leaves out.

    The public surface is :func:`public_api.surface` (``tools/public_api.py``): ``ortcapture.__all__``,
    ``ortcapture.webgpu``, ``ortcapture.dropin.__all__``, ``ortcapture.serving.__all__``. A name re-exported by
    ``ortcapture`` may be documented there (``ortcapture.patched`` for ``ortcapture.dropin.patched``).
    """
    import public_api
    from sphinx.util import logging

    log = logging.getLogger("ortcapture.docs")
    objects = env.get_domain("py").objects
    for name, value in public_api.surface().items():
        if type(value).__name__ == "module":
            wanted = {value.__name__}
        else:
            wanted = {name, "ortcapture." + name.rsplit(".", 1)[1]}
        if not wanted & set(objects):
            log.warning("the API reference does not document %s (public)", name)


def _no_property_type(app, what, name, obj, options, lines):
    """``autodoc-process-docstring``, before napoleon: napoleon reads the first line ``X: Y`` of a property's,
    attribute's or constant's docstring as ``type: description`` (``Whether a later replay (or a re-capture: ...)``
    lost its first half). ortcapture states types in annotations, so an empty type is put first (napoleon drops it)."""
    if what in ("property", "attribute", "data") and lines and ":" in lines[0]:
        lines[0] = ": " + lines[0]


def _list_every_guide(app, docname, source):
    """``source-read`` of the index: a guide (``docs/*.md``) its toctree does not list yet joins it at the end, so a
    new guide is in the rendered docs the day it lands (list it in index.md to give it its place)."""
    if docname != root_doc:
        return
    listed = set(re.findall(r"(?m)^([A-Za-z0-9_./-]+)\s*$", source[0]))
    extra = sorted(p.stem for p in Path(app.srcdir).glob("*.md") if p.stem != root_doc and p.stem not in listed)
    if extra:
        source[0] += "\n```{toctree}\n:caption: More guides\n:maxdepth: 2\n\n" + "\n".join(extra) + "\n```\n"


def _data_comment(app, what, name, obj, options, lines):
    """``autodoc-process-docstring`` of a public constant: its ``#:`` comment where it is defined.

    autodoc looks for the comment in the module the directive names (``ortcapture`` for ``ortcapture.DEFAULT_RTOL``,
    defined in ``ortcapture._verify.compare``) and otherwise shows the docstring of the value's type (``float``'s).
    Without a comment the build warns: a public constant needs one (interrogate does not check constants).
    """
    if what != "data" or not name.startswith("ortcapture."):
        return
    import ortcapture
    from sphinx.pycode import ModuleAnalyzer
    from sphinx.util import logging

    module, short = name.rsplit(".", 1)
    source = ortcapture._EXPORTS.get(short, module) if module == "ortcapture" else module
    doc = ModuleAnalyzer.for_module(source).find_attr_docs().get(("", short))
    if doc:
        lines[:] = [line for line in doc if line.strip() or lines]
    else:
        lines[:] = []
        logging.getLogger("ortcapture.docs").warning("public constant %s has no #: comment in %s", name, source)


#: reference page -> the public modules whose names it documents (tools/public_api.py's surface)
REFERENCE_PAGES = {"reference/api": ("ortcapture", "ortcapture.dropin"), "reference/serving": ("ortcapture.serving",)}


def _document_new_names(app, docname, source):
    """``source-read`` of a reference page: a public name the page does not name yet is appended to it (section
    "More names"), so a name added to ``__all__`` is in the reference the day it lands (give it its place on the
    page by naming it there). Its docstring is interrogate's business (tools/docs.sh)."""
    modules = REFERENCE_PAGES.get(docname)
    if modules is None:
        return
    import inspect

    import public_api

    text = source[0]
    extra = []
    for name, value in public_api.surface().items():
        module, short = name.rsplit(".", 1)
        if module not in modules or inspect.ismodule(value):
            continue
        if re.search(rf":: (ortcapture\.)?({re.escape(module)}\.)?{re.escape(short)}\s*$", text, re.M):
            continue
        if inspect.isclass(value):
            kind = "autoexception" if issubclass(value, BaseException) else "autoclass"
        elif callable(value):
            kind = "autofunction"
        else:
            kind = "autodata"
        extra.append(f".. {kind}:: {name}")
    if extra:
        source[0] = text + "\nMore names\n----------\n\n" + "\n\n".join(extra) + "\n"


def setup(app):
    app.connect("source-read", _list_every_guide)
    app.connect("source-read", _document_new_names)
    app.connect("autodoc-process-docstring", _data_comment, priority=400)
    app.connect("autodoc-process-docstring", _no_property_type, priority=450)  # napoleon's runs at 500
    app.connect("missing-reference", _resolve_facade_names)
    app.connect("env-check-consistency", _check_public_surface)
    return {"parallel_read_safe": True}
