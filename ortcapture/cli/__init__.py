"""The ``ortcapture`` command: ``demo``, ``bench``, ``doctor``, ``patch``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; this file
only wires them up. No subcommand module imports onnxruntime at import time, so ``--help`` always works; ``patch``
runs without onnxruntime (it patches ORT source trees, on build machines that have none installed), and every other
subcommand, where none is installed, prints one line naming the extras that install it and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("ortcapture.cli.demo", "capture and replay a real model, verify it, and print a timing table"),
    "bench": ("ortcapture.cli.bench", "benchmark captured replay against raw ORT in fresh processes"),
    "doctor": ("ortcapture.cli.doctor", "say whether (and why not) a model can be captured"),
    "patch": ("ortcapture.cli.patch", "check/apply/revert ortcapture's patches on an ORT source tree"),
    "selftest": ("ortcapture.cli.selftest", "check that the installed ORT build carries the patched fixes"),
}
#: subcommands that run without onnxruntime
WITHOUT_ORT = {"patch"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ortcapture", description=__doc__.splitlines()[0])
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command_module is None:
        print(f"ortcapture {args.command}: not available in this build", file=sys.stderr)
        return 2
    if args.command not in WITHOUT_ORT:
        try:
            importlib.import_module("onnxruntime")
        except ModuleNotFoundError as exc:
            if exc.name != "onnxruntime":
                raise
            from ortcapture import _MISSING_ORT

            print(f"ortcapture {args.command}: {_MISSING_ORT}", file=sys.stderr)
            return 2
    from ortcapture.errors import CaptureError

    try:
        return int(args.command_module.run(args) or 0)
    except CaptureError as exc:  # a refusal with its reason: no traceback for the user
        print(f"ortcapture {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
