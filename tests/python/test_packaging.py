"""Packaging: the build record, the torch pin and its import-time check, the
sdist's contents, and setup.py's messages for missing prerequisites.

The full route (sdist -> wheel -> fresh venv -> Python example and a CMake
consumer of the installed wheel) is scripts/check_wheel.sh, run by CI.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import types

import pytest
import torch

import kvcache
from kvcache import _library

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS_FILE = os.path.join(ROOT, "cmake", "build_settings.json")
needs_source = pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, "setup.py")), reason="needs the source tree"
)


def major_minor(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def torch_specifiers(requirements):
    """{'>=2.13', '<2.14'} from the requirement lines naming torch (no extras)."""
    reqs = [r.replace(" ", "") for r in requirements if r.replace(" ", "").startswith("torch")]
    assert len(reqs) == 1, requirements
    return set(reqs[0][len("torch"):].split(";")[0].split(","))


def info(torch_version="2.13.0+cpu", torch_cuda=None, with_cuda=False, toolkit=None):
    return types.SimpleNamespace(
        VERSION="0.1.0+cpu" if not with_cuda else "0.1.0+cu130",
        TORCH_VERSION=torch_version,
        TORCH_CUDA_VERSION=torch_cuda,
        WITH_CUDA=with_cuda,
        CUDA_TOOLKIT=toolkit,
    )


# ---- the build record and the version --------------------------------------


def test_build_record_matches_the_running_library():
    rec = _library.build_info_file()
    built = kvcache.build_info()
    assert kvcache.__version__ == rec.VERSION
    assert rec.WITH_CUDA == built["with_cuda"]
    # the compiled-in torch version (C++ macro) and the record agree
    assert major_minor(rec.TORCH_VERSION) == major_minor(built["torch_version"])
    assert major_minor(rec.TORCH_VERSION) == major_minor(torch.__version__)
    base, local = rec.VERSION.split("+")
    assert local == ("cpu" if not rec.WITH_CUDA else "cu" + rec.CUDA_TOOLKIT.replace(".", ""))
    if os.path.exists(SETTINGS_FILE):
        with open(SETTINGS_FILE, encoding="utf-8") as f:
            assert base == json.load(f)["version"]


def test_installed_metadata_pins_the_build_torch():
    try:
        dist = importlib.metadata.distribution("kvcache")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kvcache is not installed (only on sys.path)")
    assert dist.version == kvcache.__version__
    major, minor = major_minor(_library.build_info_file().TORCH_VERSION)
    assert torch_specifiers(dist.requires or []) == {f">={major}.{minor}", f"<{major}.{minor + 1}"}
    assert not any(r.startswith("numpy") and "extra" not in r for r in dist.requires), dist.requires


# ---- the import-time torch check ------------------------------------------------


def test_same_major_minor_is_accepted():
    assert _library.torch_mismatch(info(), "2.13.0+cpu", None) is None
    assert _library.torch_mismatch(info(), "2.13.1", "13.0") is None  # a CPU build runs on CUDA torch
    cuda = info("2.14.1+cu130", "13.0", True, "13.0")
    assert _library.torch_mismatch(cuda, "2.14.0", "13.2") is None


@pytest.mark.parametrize("running", ["2.14.1", "2.12.0+cpu", "3.13.0"])
def test_other_major_minor_is_refused_with_the_fix(running):
    msg = _library.torch_mismatch(info(), running, None)
    assert msg is not None
    assert "2.13.0+cpu" in msg and running in msg
    assert "pip install --no-build-isolation" in msg and "torch==2.13.*" in msg


def test_cuda_build_needs_a_cuda_torch_of_its_cuda_major():
    cuda = info("2.14.1+cu130", "13.0", True, "13.0")
    msg = _library.torch_mismatch(cuda, "2.14.1+cpu", None)
    assert msg is not None and "has no CUDA" in msg and "CUDA 13" in msg
    msg = _library.torch_mismatch(cuda, "2.14.1+cu126", "12.6")
    assert msg is not None and "uses CUDA 12.6" in msg


def test_import_refuses_another_torch_before_loading_the_library():
    code = (
        "import torch\n"
        "torch.__version__ = '2.99.0'\n"
        "try:\n"
        "    import kvcache\n"
        "except ImportError as e:\n"
        "    print('REFUSED:', e)\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('LOADED' if 'libkvcache.so' in maps else 'NOT LOADED')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED: kvcache" in proc.stdout and "torch 2.99.0 is installed" in proc.stdout
    assert "--no-build-isolation" in proc.stdout
    assert "NOT LOADED" in proc.stdout, proc.stdout


# ---- the sdist -------------------------------------------------------------------


def tracked_files():
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("needs a git checkout")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if os.path.exists(os.path.join(ROOT, f))]


@needs_source
def test_sdist_holds_every_source_and_no_build_output(tmp_path):
    wanted = [
        f for f in tracked_files()
        if f.startswith(("csrc/", "cmake/", "tests/", "benchmarks/", "scripts/", "python/"))
        or f in ("CMakeLists.txt", "setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in")
    ]
    assert any(f.endswith(".h") for f in wanted)
    proc = subprocess.run(
        # egg_info outside the tree: python/kvcache.egg-info would shadow the installed metadata
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
         "sdist", "-d", str(tmp_path), "--formats=gztar"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sdist,) = tmp_path.glob("kvcache-*.tar.gz")
    # the sdist is the sources: no backend label, no torch pin of its own
    settings = json.load(open(SETTINGS_FILE, encoding="utf-8"))
    assert sdist.name == f"kvcache-{settings['version']}.tar.gz"
    names = tarfile.open(sdist).getnames()
    prefix = names[0].split("/")[0] + "/"
    inside = {n[len(prefix):] for n in names}
    missing = [f for f in wanted if f not in inside and not f.endswith((".png",))]
    assert not missing, f"MANIFEST.in leaves out: {missing}"
    built = [n for n in inside if n.endswith((".so", ".o")) or n.endswith("_build_info.py")
             or n.startswith(("python/kvcache/include/", "python/kvcache/share/"))]
    assert not built, built


# ---- setup.py's prerequisite messages ---------------------------------------


def run_setup(tmp_path, prelude):
    """Runs setup.py's metadata step (no compile) after `prelude`."""
    code = (
        "import runpy, sys\n" + prelude +
        f"\nsys.argv = ['setup.py', '-q', 'egg_info', '--egg-base', {str(tmp_path)!r}]\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


@needs_source
def test_setup_without_torch_says_to_build_without_isolation(tmp_path):
    proc = run_setup(tmp_path, "sys.modules['torch'] = None")
    assert proc.returncode != 0
    assert "torch is not importable" in proc.stderr
    assert "pip install --no-build-isolation ." in proc.stderr
    assert "python -m build --no-isolation" in proc.stderr
    assert "Traceback" not in proc.stderr
    # in pip's isolated build environment it says why torch is not seen
    proc = run_setup(tmp_path, "sys.modules['torch'] = None\nsys.path.append('/tmp/pip-build-env-x/overlay')")
    assert "isolated build" in proc.stderr and "cannot see the torch you installed" in proc.stderr


@needs_source
def test_setup_with_old_setuptools_names_the_version(tmp_path):
    proc = run_setup(tmp_path, "import setuptools\nsetuptools.__version__ = '69.5.1'")
    assert proc.returncode != 0
    assert "setuptools >= 77 is needed, found 69.5.1" in proc.stderr
    assert "pip install 'setuptools>=77'" in proc.stderr


@needs_source
def test_setup_without_ninja_says_it_is_optional(tmp_path):
    proc = run_setup(
        tmp_path, "import torch.utils.cpp_extension as c\nc.is_ninja_available = lambda: False"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ninja not found" in proc.stderr and "pip install ninja" in proc.stderr
    assert "optional" in proc.stderr
    # the metadata step records the pin on this torch's major.minor
    (egg,) = tmp_path.glob("*.egg-info")
    requires = (egg / "requires.txt").read_text().split("\n\n")[0].split()  # before the extras
    major, minor = major_minor(torch.__version__)
    assert torch_specifiers(requires) == {f">={major}.{minor}", f"<{major}.{minor + 1}"}
