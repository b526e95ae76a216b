"""Packaging: ortcapture installs beside either ONNX Runtime distribution and works without one where it can.

``onnxruntime`` and ``onnxruntime-gpu`` are two distributions of the one ``onnxruntime`` package, so ortcapture
depends on neither (extras ``cpu`` / ``cuda`` pick one). Without any, ``import ortcapture`` and ``ortcapture patch``
work (patches are applied on source-build machines that have no ORT), and the first use that needs ORT raises one
error naming the extras. The no-ORT runs are subprocesses whose meta path refuses to import onnxruntime.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.children import run_python

ROOT = Path(__file__).resolve().parents[1]
# a fresh interpreter in which ``import onnxruntime`` fails as it does where no ORT distribution is installed
NO_ORT = """
import importlib.abc, sys
class _NoOrt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "onnxruntime" or name.startswith("onnxruntime."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoOrt())
"""
CLI = NO_ORT + "from ortcapture.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def run_without_ort(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_python(code, *args, cwd=cwd, timeout=120)


def test_import_without_ort_and_the_first_use_names_the_extras():
    proc = run_without_ort(NO_ORT + """
import ortcapture
from ortcapture.errors import CaptureError  # the error types need no ORT
print(ortcapture.__version__)
try:
    from ortcapture import InferenceSession
except ModuleNotFoundError as exc:
    print("name:", exc.name)
    print("error:", exc)
try:
    ortcapture.update_inplace
except ModuleNotFoundError as exc:
    print("again:", exc)
""")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == __import__("ortcapture").__version__
    assert lines[1] == "name: onnxruntime"
    for line in lines[2:]:
        assert "ortcapture[cpu]" in line and "ortcapture[cuda]" in line and "onnxruntime-gpu" in line


def test_patch_command_without_ort(tmp_path):
    proc = run_without_ort(CLI, "patch", "check", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--ort-src" in proc.stdout
    pytest.importorskip("unidiff")
    from tests.test_patch import SERIES, make_tree

    src = str(make_tree(tmp_path, SERIES[0], git=False))  # needs GNU patch, as ortcapture patch does
    assert run_without_ort(CLI, "patch", "check", "--ort-src", src).returncode == 1  # pending
    proc = run_without_ort(CLI, "patch", "apply", "--ort-src", src)
    assert proc.returncode == 0, proc.stderr
    assert run_without_ort(CLI, "patch", "check", "--ort-src", src).returncode == 0


@pytest.mark.parametrize("argv", [["demo"], ["doctor", "model.onnx"], ["bench", "model.onnx"]])
def test_commands_that_need_ort_say_which_extra(argv):
    proc = run_without_ort(CLI, *argv)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()  # one line, no traceback
    assert line.startswith(f"ortcapture {argv[0]}: ortcapture needs ONNX Runtime")
    assert "ortcapture[cpu]" in line and "ortcapture[cuda]" in line


def test_help_of_every_command_without_ort():
    for command in ("demo", "bench", "doctor", "patch"):
        proc = run_without_ort(CLI, command, "--help")
        assert proc.returncode == 0, (command, proc.stderr)


def test_pyproject_pins_no_ort_distribution_and_ships_the_patches():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    meta, setuptools_cfg = project["project"], project["tool"]["setuptools"]
    names = [dep.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
             for dep in meta["dependencies"]]
    assert not {"onnxruntime", "onnxruntime-gpu"} & set(names)
    extras = meta["optional-dependencies"]
    assert any(d.startswith("onnxruntime>=") for d in extras["cpu"])
    for extra in ("cuda", "cuda12"):  # ORT's own CUDA extras, and cuda-python of one CUDA major (test_gpu_extras)
        assert any(d.startswith("onnxruntime-gpu[cuda,cudnn]>=") for d in extras[extra])
        assert any(d.startswith("cuda-python>=") and ",<" in d for d in extras[extra])
    # the plugin EP declares no ORT dependency and needs Python >= 3.11
    assert len(extras["webgpu"]) == 1 and "python_version >= '3.11'" in extras["webgpu"][0]
    assert {"bf16", "bench", "test"} <= set(extras)
    # one version source
    assert "version" not in meta and "version" in meta["dynamic"]
    assert setuptools_cfg["dynamic"]["version"] == {"attr": "ortcapture.__version__"}
    # the top-level patches/ is the package data folder ortcapture.patches: every patch file and py.typed ship
    assert setuptools_cfg["package-dir"] == {"ortcapture.patches": "patches"}
    assert "ortcapture.patches" in setuptools_cfg["packages"]
    patch_globs = setuptools_cfg["package-data"]["ortcapture.patches"]
    shipped = {p for g in patch_globs for p in (ROOT / "patches").glob(g)}
    data = {p for p in (ROOT / "patches").rglob("*") if p.is_file()}
    assert data and data <= shipped
    assert setuptools_cfg["package-data"]["ortcapture"] == ["py.typed"]
    assert (ROOT / "ortcapture" / "py.typed").is_file()


def test_the_wheel_ships_every_package_and_the_patches(tmp_path):
    """The built wheel holds every package under ``ortcapture/`` (each folder with an ``__init__.py``, every module
    of it), ``py.typed``, every file of ``patches/`` as ``ortcapture/patches/``, and the ``ortcapture`` command.
    pyproject.toml lists the packages by hand: a new subpackage missing there fails here."""
    import shutil
    import zipfile

    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:  # the build-system requirement (PEP 639 license field)
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (the test extra installs a newer one)")
    src = tmp_path / "src"  # a copy: the build writes build/ and *.egg-info into the tree it builds
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("ortcapture", "patches"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("ortcapture-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    packages = sorted(p.parent for p in (ROOT / "ortcapture").rglob("__init__.py") if "__pycache__" not in p.parts)
    assert len(packages) >= 7  # ortcapture, _buckets, _core, _memory, _ort, _verify, cli (and serving, ...)
    missing = [p.relative_to(ROOT).as_posix() for p in packages
               if f"{p.relative_to(ROOT).as_posix()}/__init__.py" not in names]
    assert not missing, f"packages missing from the wheel (add them to pyproject.toml's packages): {missing}"
    modules = {p.relative_to(ROOT).as_posix() for pkg in packages for p in pkg.glob("*.py")}
    assert modules <= names, sorted(modules - names)
    # the serving subpackage (issue 29) and its extra
    assert {"ortcapture/serving/__init__.py", "ortcapture/serving/deployment.py", "ortcapture/serving/protocol.py",
            "ortcapture/cli/serve.py"} <= names
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "Provides-Extra: serve" in metadata
    assert "ortcapture/py.typed" in names
    patch_files = {"ortcapture/patches/" + p.relative_to(ROOT / "patches").as_posix()
                   for p in (ROOT / "patches").rglob("*") if p.is_file()}
    assert any(n.endswith(".patch") for n in patch_files) and "ortcapture/patches/README.md" in patch_files
    assert patch_files <= names, sorted(patch_files - names)
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "tools/", "docs/"))]
    assert "ortcapture = ortcapture.cli:main" in entry_points
