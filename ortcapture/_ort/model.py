"""The model as a session was built from it: :class:`ModelSource`.

What ORT does and ortcapture must match: an ``onnxruntime.InferenceSession`` keeps running the model it was built
from, whatever happens to the file afterwards. What ortcapture builds later from "the same model" — shape-specialised
siblings (``capture()`` on a shape-deferred session, ``static_shapes=``, buckets), the CPU EP session of the
EP-accuracy check, and the C session that ``compact()`` and ``set_providers()`` rebuild through ORT's
``_reset_session`` (which reads ``_model_path`` again) — used to read the path again: a file replaced after
construction was silently captured (``verify=False``) or reported as a capture fault (``verify=True``), and a deleted
one gave a bare ``FileNotFoundError``. Here every later build starts from the bytes read at construction (a model
given as bytes or ``ModelProto`` is kept as given).

Weights in external data files stay on disk (they can be far larger than memory allows to copy): their size,
modification time and inode are recorded at construction and checked before each later build, which raises
:class:`~ortcapture.errors.CaptureError` naming a file that changed or is gone (:meth:`ModelSource.check_external`).

Models over 2 GB (protobuf's limit for one message) must keep their weights external. Every rewrite (fixed input
dims, the WebGPU view-output ``Cast``) works on the graph without its external data and serialises the graph only
(:meth:`ModelSource.structure`); ORT then finds the weights through the session config entry
``session.model_external_initializers_file_folder_path`` (:func:`external_folder`; present in ORT 1.24.4 and 1.32.0:
a session built from bytes otherwise refuses the external data — "External data path validation failed" on 1.32,
"model_path must not be empty" on 1.24.4). The caller's ``SessionOptions`` cannot be copied, so the entry is set on
them for the build and put back afterwards (ORT logs "Config with key ... already exists ... overwritten" then).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import onnx

from ortcapture.errors import CaptureError

#: ORT's session config key (``kOrtSessionOptionsModelExternalInitializersFileFolderPath``): where a model built from
#: bytes finds its external data files
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _external_locations(model: onnx.ModelProto) -> list[str]:
    """The ``location`` of every tensor of ``model`` (subgraphs included) stored as external data, once each."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    out: list[str] = []
    for t in _get_all_tensors(model):
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc and loc not in out:
                out.append(loc)
    return out


class ModelSource:
    """A session's model as it was at construction.

    Args:
        given: what the caller passed as ``path_or_bytes`` (a path, ``bytes`` or an ``onnx.ModelProto``).
        keep: read a path's bytes now (``True``: a session that captures or may capture builds more sessions of the
            model later); ``False`` keeps only the path (a session without capture: nothing is built again but what
            ORT itself rebuilds).

    Attributes:
        given: as passed. ``path``: the absolute path, or ``None``. ``data``: the serialised model read at
            construction (a path), or the bytes / ``ModelProto`` as given; ``None`` when the path could not be read
            (ORT's own constructor then raises its error). ``folder``: where external data files are resolved (the
            model's directory), or ``None`` for bytes (ORT resolves those itself, against the caller's own
            ``session.model_external_initializers_file_folder_path`` or the working directory).
    """

    def __init__(self, given: Any, keep: bool = True) -> None:
        self.given = given
        self.path: str | None = None
        self.folder: str | None = None
        self.data: Any = None
        self._parses: bool | None = None  # whether onnx reads the model (None: not asked yet)
        self._external: dict[str, tuple[int, int, int] | None] = {}
        if isinstance(given, (str, os.PathLike)):
            self.path = os.path.abspath(os.fspath(given))
            self.folder = os.path.dirname(self.path)
            if keep:
                self.keep()
        else:
            self.data = bytes(given) if isinstance(given, bytearray) else given

    def keep(self) -> None:
        """Read a path's bytes now (once) and record its external data files (a session that did not capture at
        construction and gets capture through ``set_providers``)."""
        if self.path is None or self.data is not None:
            return
        try:
            with open(self.path, "rb") as f:
                self.data = f.read()
        except OSError:
            return  # ORT's constructor says what is wrong with the path
        model = self.try_structure()
        self._parses = model is not None
        if model is not None:
            for loc in _external_locations(model):
                full = os.path.normpath(os.path.join(self.folder, loc))
                self._external[full] = _stat(full)

    # -- what the model is ---------------------------------------------------------------------------------------
    def readable(self) -> bool:
        """Whether the model could be read (a path) and onnx parses it. ``False`` means ortcapture must not give its
        own error for it: the caller's session lets ORT's constructor raise ORT's (``NoSuchFile``, ``InvalidProtobuf``,
        ...) exactly as a raw ``onnxruntime.InferenceSession`` does, or build it (an ORT-format model)."""
        self.keep()
        if self.data is None:
            return False
        if self._parses is None:
            self._parses = self.try_structure() is not None
        return self._parses

    @property
    def external_files(self) -> list[str]:
        """Absolute paths of the external data files the model's tensors name (a path model only)."""
        return list(self._external)

    def model(self) -> Any:
        """The model to hand ORT for a later build: the construction-time bytes (a path), or the model as given."""
        self.keep()
        if self.data is None:
            raise CaptureError(f"the model file {self.path!r} could not be read")
        return self.data

    def structure(self) -> onnx.ModelProto:
        """A fresh ``ModelProto`` of the model without its external data (tensors stored externally keep their
        references): safe to change, and serialisable past 2 GB of weights. Raises what onnx raises for a model it
        cannot read (e.g. an ORT-format model)."""
        self.keep()
        data = self.model()
        if isinstance(data, onnx.ModelProto):
            copy = onnx.ModelProto()
            copy.CopyFrom(data)
            return copy
        return onnx.load_from_string(bytes(data))

    def try_structure(self) -> onnx.ModelProto | None:
        """:meth:`structure`, or ``None`` where onnx cannot read the model."""
        try:
            return self.structure()
        except Exception:  # noqa: BLE001 - DecodeError and friends: ORT gives its own error for a bad model
            return None

    # -- the external weights ----------------------------------------------------------------------------------
    def check_external(self, what: str = "build a session of the model again") -> None:
        """Raise :class:`CaptureError` when an external data file changed (size, modification time or inode) or is
        gone since construction: a session built now would read other weights than the session has."""
        changed, gone = [], []
        for path, then in self._external.items():
            now = _stat(path)
            if now is None:
                gone.append(path)
            elif now != then:
                changed.append(path)
        if changed or gone:
            parts = ([f"changed: {', '.join(changed)}"] if changed else []) + \
                    ([f"gone: {', '.join(gone)}"] if gone else [])
            raise CaptureError(
                f"the model's external data file(s) changed since the session was built ({'; '.join(parts)}): "
                f"ortcapture keeps the model's graph as it was loaded, but its weights stay on disk, so it cannot "
                f"{what} with the weights the session runs. Put the files back as they were, or create a new "
                "session.")

    def build_kwargs(self) -> dict:
        """What :func:`external_folder` needs for a build from :meth:`model` (or a rewrite of it)."""
        return {"folder": self.folder if self._external else None}


@contextlib.contextmanager
def external_folder(sess_options, folder: str | None) -> Iterator[Any]:
    """Yield ``SessionOptions`` for a build from bytes whose external data lives in ``folder``: ``sess_options`` with
    :data:`EXTERNAL_FOLDER_KEY` set for the block and put back afterwards (an unset entry becomes ``""``, which ORT
    reads as unset), or a new ``SessionOptions`` when ``sess_options`` is ``None``. ``folder=None``: ``sess_options``
    unchanged. A caller's own folder entry is kept (it said where the weights are)."""
    if folder is None:
        yield sess_options
        return
    import onnxruntime as ort

    if sess_options is None:
        so = ort.SessionOptions()
        so.add_session_config_entry(EXTERNAL_FOLDER_KEY, folder)
        yield so
        return
    try:
        before = sess_options.get_session_config_entry(EXTERNAL_FOLDER_KEY)
    except RuntimeError:  # ORT: "SessionOptions does not have configuration with key"
        before = ""
    if before:
        yield sess_options
        return
    sess_options.add_session_config_entry(EXTERNAL_FOLDER_KEY, folder)
    try:
        yield sess_options
    finally:
        sess_options.add_session_config_entry(EXTERNAL_FOLDER_KEY, before)
