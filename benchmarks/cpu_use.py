"""Where a serving benchmark's CPU time goes: per process group, between two samples (issue 44: what bounds the
served images/s on a machine whose cores the server and its clients share), and optional py-spy profiles.

:func:`sample` reads every process's CPU time with psutil (Ray's own copy, ``ray/thirdparty_files``, is on the path
once ``ray`` is imported); :func:`use` turns two samples into cores used per group: Ray's worker processes by their
title (``ray::ServeReplica:<app>:<deployment>``, ``ray::ProxyActor``, ...), the benchmark's client processes and
driver by pid, everything else by process name (``raylet``, ``gcs_server``, ...). ``machine_busy_cores`` is the
whole machine's (``/proc/stat``). :class:`PySpy` records a few processes' stacks (``py-spy record --format raw``:
collapsed stacks, one line per stack with its sample count) while a measurement runs.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

_METHOD = re.compile(r"\.\w+$")  # Ray titles an actor busy in a method "ray::Class.method"


def _title(cmd: list) -> str | None:
    """A Ray worker's title without the method it is running (``ray::ServeReplica:app:Model``), else ``None``."""
    first = (cmd[0] if cmd else "").split()
    if not first or not first[0].startswith("ray::"):
        return None
    return _METHOD.sub("", first[0])


def _group(info: dict, named: dict[int, str], pid: int) -> str:
    if pid in named:
        return named[pid]
    return _title(info.get("cmdline") or []) or info.get("name") or "?"


def sample(named: dict[int, str] | None = None) -> tuple:
    """``(perf_counter, {pid: (group, cpu seconds)}, psutil.cpu_times())``; ``named``: groups given by pid."""
    import psutil

    named = named or {}
    procs = {}
    for p in psutil.process_iter(["cmdline", "name", "cpu_times"]):
        try:
            t = p.info["cpu_times"]
            if t is None:
                continue
            procs[p.pid] = (_group(p.info, named, p.pid), t.user + t.system)
        except Exception:  # noqa: BLE001 - gone meanwhile, or not ours to read
            continue
    return time.perf_counter(), procs, psutil.cpu_times()


def use(a: tuple, b: tuple, least: float = 0.05) -> dict:
    """Cores used between samples ``a`` and ``b``: ``{"wall_s", "machine_busy_cores", "cores": total of the
    processes, "groups": {group: {"cores", "procs", "max_proc_cores"}}}`` (groups under ``least`` cores left out;
    a process born between the samples counts from zero)."""
    wall = max(b[0] - a[0], 1e-9)
    groups: dict[str, list] = {}
    for pid, (g, t1) in b[1].items():
        t0 = a[1].get(pid, (g, 0.0))[1]
        cores = max(t1 - t0, 0.0) / wall
        e = groups.setdefault(g, [0.0, 0, 0.0])
        e[0] += cores
        e[1] += 1
        e[2] = max(e[2], cores)
    ta, tb = a[2], b[2]
    total = sum(tb) - sum(ta)
    idle = (tb.idle + getattr(tb, "iowait", 0.0)) - (ta.idle + getattr(ta, "iowait", 0.0))
    ncpu = os.cpu_count() or 1
    busy = (1 - idle / total) * ncpu if total > 0 else None
    out = {g: {"cores": round(c, 2), "procs": n, "max_proc_cores": round(m, 2)}
           for g, (c, n, m) in sorted(groups.items(), key=lambda kv: -kv[1][0]) if c >= least}
    return {"wall_s": round(wall, 2), "machine_busy_cores": None if busy is None else round(busy, 2),
            "cpus": ncpu, "cores": round(sum(e[0] for e in groups.values()), 2), "groups": out}


def pids_of(title_suffix: str) -> list[int]:
    """Pids of processes whose title (``cmdline[0]``) starts with ``ray::`` and ends with ``title_suffix``."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        title = _title(p.info.get("cmdline") or [])
        if title is not None and title.endswith(title_suffix):
            out.append(p.pid)
    return out


class PySpy:
    """``py-spy record`` of each pid in ``targets`` (``{label: pid}``) for ``seconds``, raw collapsed stacks into
    ``<out>/pyspy-<tag>-<label>.txt`` (bounded: py-spy stops itself after ``seconds``; :meth:`wait` waits at most
    ``seconds + 15``)."""

    def __init__(self, exe: str, targets: dict[str, int], seconds: float, out: str, tag: str, rate: int = 200):
        self.runs: list[tuple] = []  # (Popen or None, path, why not started)
        self.errs: dict[str, str] = {}
        for label, pid in targets.items():
            path = os.path.join(out, f"pyspy-{tag}-{label}.txt")
            cmd = [exe or "py-spy", "record", "--pid", str(pid), "--duration", str(max(1, int(round(seconds)))),
                   "--rate", str(rate), "--format", "raw", "--threads", "--output", path]
            # PY_SPY_NATIVE=1: native frames too (C extensions: protobuf, gRPC's core, Ray's core worker); py-spy
            # pauses the process for each sample then (it cannot unwind native stacks without stopping it)
            cmd.insert(-2, "--native" if os.environ.get("PY_SPY_NATIVE") == "1" else "--nonblocking")
            try:  # stderr to a file: a pipe nobody reads until the end could fill and block py-spy
                err = open(path + ".err", "wb")
                self.runs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err), path, None))
                err.close()
            except OSError as exc:
                self.runs.append((None, path, f"not started: {exc}"))
        self.seconds = seconds

    def wait(self) -> list[str]:
        """Wait for every recording (each at most ``seconds + 15``, then killed and reaped); per target the file
        written, or the file and why it is not there."""
        done = []
        for p, path, why in self.runs:
            if p is None:
                done.append(f"{path}: {why}")
                continue
            try:
                p.wait(timeout=self.seconds + 15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.returncode == 0:
                done.append(path)
            else:
                try:
                    tail = open(path + ".err", "rb").read()[-300:].decode(errors="replace")
                except OSError:
                    tail = ""
                done.append(f"{path}: rc {p.returncode} {tail}")
        return done


def summarize(path: str, top: int = 15) -> dict:
    """A py-spy raw file (``stack count`` per line, frames ``;``-joined, the thread first): samples per thread, the
    frames where samples were taken (``self``) and the frames on the stack (``inclusive``), most first."""
    threads: dict[str, int] = {}
    own: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            threads[frames[0]] = threads.get(frames[0], 0) + n
            own[frames[-1]] = own.get(frames[-1], 0) + n
            for fr in set(frames[1:]):
                incl[fr] = incl.get(fr, 0) + n

    def most(d):
        return [(k, v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return {"samples": total, "threads": most(threads), "self": most(own), "inclusive": most(incl)}


if __name__ == "__main__":  # python benchmarks/cpu_use.py PYSPY.txt ...: what each recording spent its samples on
    import sys

    for p in sys.argv[1:]:
        s = summarize(p)
        print(f"== {p}: {s['samples']} samples")
        for part in ("threads", "self", "inclusive"):
            print(f"  -- {part}")
            for k, v in s[part]:
                print(f"  {v:6d} {100 * v / max(s['samples'], 1):5.1f}%  {k[:150]}")
