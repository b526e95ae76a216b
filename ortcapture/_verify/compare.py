"""One verification of captured replays against a reference run: used by capture, batch buckets and ``doctor``.

A captured graph can return wrong numbers with no error (issue 15): outputs ORT copies once at capture, kernels that
read an input on the host, int64 run as 32-bit, copy-only kernels whose copy is not replayed. Every capture path
checks its replay here, the same way:

* ``level="example"``: the replay of the example feeds against a reference run of the same feeds;
* ``level="full"`` (the default): that, plus a second input set in which every input differs from the example
  (:func:`vary`), fed to both — an output that only matched because it kept the capture-time value is caught;
* ``level="off"``: no check (``verify=False``).

The caller supplies ``replay(feeds)`` and ``reference(feeds)`` (each returns one numpy array per compared output)
and restores its example afterwards. Comparison (:func:`compare`): exact (bit-equal, NaN equal to NaN) when
``rtol`` is None, which is right when the reference runs the same kernels at the same shapes (CUDA: the same session
with ``gpu_graph_id=-1``; ``use_tf32=0`` for MatMul/Conv); otherwise floating outputs pass when
``max|got - want| <= rtol * max(max|want|, 1e-6)`` (a relative error against the output's scale, so outputs near
zero do not fail on rounding) and other dtypes must be equal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ortcapture.errors import CaptureError

#: ``verify=`` values: True / "full" (default), "example", False / "off"
LEVELS = ("full", "example", "off")
#: the documented relative tolerance where reference and replay run different kernels (e.g. padded vs unpadded
#: batch; measured 2.2e-3 on YOLOv8n with ORT's TF32 default, issue 16) or a different EP (WebGPU vs the CPU EP)
DEFAULT_RTOL = 1e-2
#: the seed of the varied input set: the check is reproducible
SEED = 20261130


def level_of(verify: Any) -> str:
    """``verify=`` → one of :data:`LEVELS`. Raises :class:`CaptureError` for anything else."""
    if verify is True or verify is None:
        return "full"
    if verify is False:
        return "off"
    if isinstance(verify, str) and verify in LEVELS:
        return verify
    raise CaptureError(f"verify must be True, False, 'full', 'example' or 'off', got {verify!r}")


class VerificationError(CaptureError):
    """A captured replay differs from the reference run. ``outputs`` names the outputs that differ; ``input_set``
    is ``"example"`` or ``"varied"``; ``report`` is the :class:`~ortcapture._verify.compare.Report` so far."""

    def __init__(self, message: str, outputs: Sequence[str], input_set: str, report: "Report"):
        super().__init__(message)
        self.outputs = list(outputs)
        self.input_set = input_set
        self.report = report


@dataclass
class Report:
    """What a verification did: ``level``; ``input_sets`` checked; ``not_varied`` (inputs the varied set could not
    change, e.g. an all-equal integer input, or kept on purpose such as host-read inputs); ``max_error`` per output
    (relative for floats with a tolerance, else 0.0/1.0 for equal/different); ``seconds`` spent."""

    level: str
    input_sets: list[str] = field(default_factory=list)
    not_varied: list[str] = field(default_factory=list)
    max_error: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def compare(names: Sequence[str], got: Sequence[np.ndarray], want: Sequence[np.ndarray],
            rtol: float | None = None) -> tuple[list[str], dict[str, float]]:
    """Compare outputs pairwise. Returns (names that differ, name -> error). Shapes and dtypes must match too."""
    bad, errors = [], {}
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            bad.append(name)
            errors[name] = float("inf")
            continue
        if g.dtype.kind in "fc" and rtol is not None:
            if g.size == 0:
                errors[name] = 0.0
                continue
            gf, wf = g.astype(np.float64), w.astype(np.float64)
            nan_g, nan_w = np.isnan(gf), np.isnan(wf)
            if not np.array_equal(nan_g, nan_w):
                bad.append(name)
                errors[name] = float("inf")
                continue
            finite = ~nan_w
            diff = np.abs(gf[finite] - wf[finite])
            inf_mismatch = np.any(np.isinf(diff)) or np.any(np.isinf(gf[finite]) != np.isinf(wf[finite]))
            scale = max(float(np.max(np.abs(wf[finite][np.isfinite(wf[finite])]), initial=0.0)), 1e-6)
            err = float("inf") if inf_mismatch else float(np.max(diff, initial=0.0)) / scale
            errors[name] = err
            if err > rtol:
                bad.append(name)
        else:
            same = np.array_equal(g, w, equal_nan=g.dtype.kind in "fc")
            errors[name] = 0.0 if same else 1.0
            if not same:
                bad.append(name)
    return bad, errors


def vary(feeds: Mapping[str, np.ndarray], keep: Sequence[str] = (), seed: int = SEED) -> tuple[dict, list[str]]:
    """A second input set in which every input differs from ``feeds``, same shapes and dtypes.

    Floats: the example plus noise of 10% of its scale (at least 0.1); integers: other values drawn from the
    example's range [min, max] (an input whose values are all equal, or empty, cannot be varied that way and is kept);
    bool: flipped where the example holds both values, else kept. Inputs named in ``keep`` (host-read inputs: capture-time
    constants) are kept. Returns (the feeds, the names kept: "not varied")."""
    rng = np.random.default_rng(seed)
    out, kept = {}, []
    for name, x in feeds.items():
        x = np.asarray(x)
        if name in keep or x.size == 0:
            out[name] = x
            kept.append(name)
            continue
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            xf = x.astype(np.float32)
            finite = xf[np.isfinite(xf)]
            scale = max(float(np.max(np.abs(finite), initial=0.0)) * 0.1, 0.1)
            # np.asarray: numpy arithmetic on a 0-d array returns a numpy scalar, which ORT's run() refuses
            y = np.asarray((xf + rng.normal(0.0, scale, x.shape).astype(np.float32)).astype(x.dtype))
            if np.array_equal(y, x):
                out[name] = x
                kept.append(name)
            else:
                out[name] = y
        elif x.dtype.kind in "iu":
            lo, hi = int(x.min()), int(x.max())
            if lo == hi:
                out[name] = x
                kept.append(name)
                continue
            y = np.asarray(rng.integers(lo, hi, size=x.shape, endpoint=True, dtype=x.dtype))
            if np.array_equal(y, x):  # tiny inputs: make one element differ
                flat = y.reshape(-1)
                flat[0] = hi if flat[0] != hi else lo
            out[name] = y
        elif x.dtype.kind == "b" and x.any() and not x.all():
            out[name] = np.asarray(~x)
        else:
            out[name] = x
            kept.append(name)
    return out, kept


def verify(replay: Callable[[dict], Sequence[np.ndarray]], reference: Callable[[dict], Sequence[np.ndarray]],
           feeds: Mapping[str, np.ndarray], names: Sequence[str], *, level: str = "full",
           rtol: float | None = None, keep: Sequence[str] = (), what: str = "the captured graph",
           doctor: str = "ortcapture doctor MODEL") -> Report:
    """Run the check at ``level`` (see the module docstring); return its :class:`Report`.

    Args:
        replay: host feeds ``{input: ndarray}`` -> outputs (numpy), from the captured replay.
        reference: the same feeds -> the reference outputs, in the same order as ``names``.
        feeds: the example feeds (host numpy arrays) the graph was captured with.
        names: output names, in the order both callables return them.
        level: ``"full"``, ``"example"`` or ``"off"``.
        rtol: None for exact, else the relative tolerance of :func:`compare`.
        keep: inputs never varied (host-read inputs).
        what: the subject named in the error.
        doctor: the ``doctor`` command line the error recommends (buckets: with ``--buckets SPEC``).

    Raises:
        VerificationError: outputs differ (named, with the input set and the error).
    The caller restores its example inputs/state afterwards (the varied set leaves its values in the buffers).
    """
    report = Report(level)
    if level == "off":
        return report
    t0 = time.perf_counter()
    sets = [("example", dict(feeds))]
    if level == "full":
        varied, kept = vary(feeds, keep)
        report.not_varied = kept
        sets.append(("varied", varied))
    for label, fs in sets:
        got, want = replay(fs), reference(fs)
        bad, errors = compare(names, got, want, rtol)
        for k, v in errors.items():
            report.max_error[k] = max(report.max_error.get(k, 0.0), v)
        report.input_sets.append(label)
        if bad:
            report.seconds = time.perf_counter() - t0
            tol = "exactly" if rtol is None else f"within rtol={rtol:g}"
            detail = ", ".join(f"{n} (error {errors[n]:.3g})" for n in bad)
            hint = (" The replay kept values from the capture (an input read on the host, a copy-only kernel, "
                    "an output written only in part)." if label == "varied" else "")
            raise VerificationError(
                f"{what}: output(s) {bad} differ from the reference run on the {label} inputs ({tol}): {detail}."
                f"{hint} Run `{doctor}` for the cause; verify=False skips this check.",
                bad, label, report)
    report.seconds = time.perf_counter() - t0
    return report
