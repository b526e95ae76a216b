"""The ``ortcapture`` command: ``demo``, ``bench``, ``doctor``, ``patch``, ``selftest``, ``serve``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them up. No subcommand module imports onnxruntime at import time, so ``--help`` always works; ``patch``
runs without onnxruntime (it patches ORT source trees, on build machines that have none installed), and every other
subcommand, where none is installed, prints one line naming the extras that install it and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("ortcapture.cli.demo", "capture and replay a real model, verify it, and print a timing table"),
    "bench": ("ortcapture.cli.bench", "benchmark captured replay against raw ORT in fresh processes"),
    "doctor": ("ortcapture.cli.doctor", "say whether (and why not) a model can be captured"),
    "patch": ("ortcapture.cli.patch", "check/apply/revert ortcapture's patches on an ORT source tree"),
    "selftest": ("ortcapture.cli.selftest", "check that the installed ORT build carries the patched fixes"),
    "serve": ("ortcapture.cli.serve", "serve a model's captured graphs over HTTP (Open Inference Protocol, Ray Serve)"),
}
#: subcommands that run without onnxruntime
WITHOUT_ORT = {"patch"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortcapture", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            p.set_defaults(command_module=None)
            continue
        module.add_arguments(p)
        p.set_defaults(command_module=module)
    return parser


#: onnxruntime's error prefix, e.g. "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : "
_ORT_PREFIX = re.compile(r"\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*[A-Z_]+\s*:\s*")
#: a Python exception line inside a child's stderr tail, e.g. "ortcapture.errors.CaptureUnsupportedError: why"
_EXC_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\w*: (.+)$")


def one_line(text) -> str:
    """An error (or its text) as one line for the terminal: onnxruntime's ``[ONNXRuntimeError] : N : CODE :`` prefix
    dropped, whitespace runs (ORT's multi-line messages) collapsed. A child's traceback tail joined with `` | ``
    (``File "...", line N`` lines, then ``module.SomeError: why``) is reduced to its last exception message."""
    text = _ORT_PREFIX.sub("", str(text))
    parts = [p.strip() for p in text.split(" | ")]
    if len(parts) > 1:
        last = _EXC_LINE.match(parts[-1])
        if last:
            head = parts[0]
            # "WebGPU probe exit code 1:   File ..., line 61, in ep_device" -> "WebGPU probe exit code 1"
            head = head.split('File "', 1)[0].rstrip(" :")
            head = re.sub(r"[^:]*\bexit code \d+$", "", head).rstrip(" :")  # the exception says more
            text = f"{head}: {last.group(1)}" if head else last.group(1)
        else:
            text = " | ".join(p for p in parts if p and not p.startswith('File "'))
    return re.sub(r"\s+", " ", text).strip()


def webgpu_env_hint() -> str:
    """A hint for a WebGPU that is unusable because the software adapter's settings are not in the environment:
    ``""`` when they are, or when ``tools/setup_webgpu.sh`` never wrote them (``$ORTCAPTURE_CACHE/webgpu.env``)."""
    import os
    from pathlib import Path

    if os.environ.get("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER") and (os.environ.get("VK_ICD_FILENAMES")
                                                               or os.environ.get("VK_DRIVER_FILES")):
        return ""  # the settings are there (a half-set environment, e.g. no Vulkan driver named, still gets the hint)
    env = Path(os.environ.get("ORTCAPTURE_CACHE") or Path.home() / ".cache" / "ortcapture") / "webgpu.env"
    if not env.is_file():
        return ""
    return f" (without a GPU, run `source {env}` first: it sets up the software adapter)"


def pick_provider(requested: str = "auto", cuda_must_load: bool = False) -> str:
    """:func:`ortcapture._ort.providers.pick_provider` with its refusal as one line (the WebGPU probe's traceback tail
    reduced to its message, plus where the software adapter's settings are). ``cuda_must_load``: ``"auto"`` refuses
    instead of falling back to WebGPU when onnxruntime-gpu's CUDA EP is there but does not load (``bench``,
    ``serve``: numbers or a service on another EP than the machine was set up for would mislead). Raises
    :class:`~ortcapture.errors.CaptureUnsupportedError`."""
    from ortcapture._ort import cuda_probe
    from ortcapture._ort.providers import pick_provider as _pick
    from ortcapture.errors import CaptureUnsupportedError

    if cuda_must_load and requested == "auto":
        why = cuda_probe.refusal()
        if why:
            raise CaptureUnsupportedError(f"{why}; --provider webgpu runs on WebGPU instead")
    try:
        return _pick(requested)
    except CaptureUnsupportedError as exc:
        # the hint once: ORT-side messages that name webgpu.env already say it (a new user read it twice)
        hint = webgpu_env_hint() if "WebGPU" in str(exc) and "webgpu.env" not in str(exc) else ""
        raise CaptureUnsupportedError(one_line(exc) + hint) from None


def cuda_fallback_note(requested: str, provider: str) -> str | None:
    """The one line to print when ``requested`` ``"auto"`` gave ``provider`` ``"webgpu"`` because onnxruntime-gpu's
    CUDA EP does not load (``None`` otherwise)."""
    from ortcapture._ort import cuda_probe

    why = cuda_probe.refusal() if requested == "auto" and provider != "cuda" else None
    return f"{why}; falling back to WebGPU" if why else None


def _is_ort_error(exc: BaseException) -> bool:
    return type(exc).__module__.startswith("onnxruntime")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; return its exit code. Errors are one line, ``ortcapture <command>: <message>``, exit 2:
    ortcapture's refusals, onnxruntime's errors and OS errors as their message, anything else with its type
    (``ORTCAPTURE_DEBUG=1`` shows the traceback instead). Ctrl-C: ``interrupted``, exit 130."""
    import os

    args = build_parser().parse_args(argv)
    prefix = f"ortcapture {args.command}"
    if args.command_module is None:
        print(f"{prefix}: not available in this build", file=sys.stderr)
        return 2
    if args.command not in WITHOUT_ORT:
        try:
            importlib.import_module("onnxruntime")
        except ModuleNotFoundError as exc:
            if exc.name != "onnxruntime":
                raise
            from ortcapture import _MISSING_ORT

            print(f"{prefix}: {_MISSING_ORT}", file=sys.stderr)
            return 2
    try:
        return int(args.command_module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the command line shows one line, never a traceback
        if os.environ.get("ORTCAPTURE_DEBUG") == "1":
            raise
        from ortcapture.errors import CaptureError

        if isinstance(exc, (CaptureError, OSError)) or _is_ort_error(exc):
            why = one_line(exc)
        else:
            why = (f"{type(exc).__name__}: {one_line(exc)} (an unexpected error: ORTCAPTURE_DEBUG=1 shows the "
                   "traceback)")
        print(f"{prefix}: {why}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
