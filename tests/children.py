"""Running test code in a child Python process: for what must not share the test process (a crash that would end
the run, state left on the process's one WebGPU device, a process without ORT importable)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, *args: str, timeout: float = 120, cwd: Path | str | None = None,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code *args`` in the repository root (or ``cwd``), the repository first on ``PYTHONPATH``, with
    ``PYTHONFAULTHANDLER=1`` (a crash prints where); ``env`` adds to this process's environment. Returns the finished
    process, its output as text; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    full = dict(os.environ, PYTHONPATH=path, PYTHONFAULTHANDLER="1", **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd or ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)
