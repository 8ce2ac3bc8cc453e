"""core.bytecode: hivetune's bytecode cache where Python keeps none for a package."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hivetune.core import bytecode

SRC = str(Path(__file__).resolve().parents[2] / "src")


def make_package(root: Path, name: str = "fakepkg") -> Path:
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    (folder / "mod.py").write_text("def f():\n    return 'mod'\n")
    (folder / "sub" / "__init__.py").write_text("")
    (folder / "sub" / "deep.py").write_text("X = [i * i for i in range(3)]\n")
    return folder


def run_python(code: str, tmp_path: Path, **extra) -> list[str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HIVETUNE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkgs"), SRC]), **extra)
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


IMPORT = ("from hivetune.core import bytecode\n"
          "prefix = bytecode.enable(('fakepkg',), workers=0)\n"
          "import os, fakepkg, fakepkg.sub.deep, importlib.util\n"
          "print(prefix, fakepkg.VALUE, importlib.util.cache_from_source(fakepkg.__file__),"
          " os.environ.get('PYTHONPYCACHEPREFIX'), os.environ.get('PYTHONDONTWRITEBYTECODE'))\n")


def test_the_cache_is_written_once_and_read_by_the_next_process(tmp_path):
    folder = make_package(tmp_path / "pkgs")
    prefix, value, cached, env_prefix, env_off = run_python(IMPORT, tmp_path)
    assert Path(prefix) == tmp_path / "cache" / "bytecode" and value == "1"
    assert (env_prefix, env_off) == (prefix, "None"), "child processes read and write the same cache"
    assert Path(cached).is_file() and Path(cached).is_relative_to(Path(prefix))
    deep = folder / "sub" / "deep.py"
    assert (Path(prefix) / str(deep.parent).lstrip(os.sep) / f"deep.{sys.implementation.cache_tag}.pyc").is_file()
    assert not any(p.name == "__pycache__" for p in folder.rglob("*")), "site-packages stay as they are"

    # Same size and mtime, other source: a process that loads the cached bytecode sees the old value.
    stat = (folder / "__init__.py").stat()
    (folder / "__init__.py").write_text("VALUE = 2\n")
    os.utime(folder / "__init__.py", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert run_python(IMPORT, tmp_path)[1] == "1"
    # Without the cache the source is compiled again.
    assert run_python(IMPORT, tmp_path, HIVETUNE_BYTECODE_CACHE="0")[:2] == ["None", "2"]
    assert run_python(IMPORT, tmp_path, HIVETUNE_BYTECODE_CACHE="0")[-1] == "1"  # left as the user set it


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """enable() on a package in tmp_path, the interpreter's settings put back afterwards."""
    folder = make_package(tmp_path / "pkgs")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("HIVETUNE_CACHE", str(tmp_path / "cache"))
    # set, then removed: monkeypatch records a variable only when it exists, and enable() may set it
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.delenv(bytecode.OFF, raising=False)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    calls = []
    monkeypatch.setattr(bytecode, "precompile", lambda folders, prefix, workers: calls.append((folders, prefix, workers)))
    return folder, calls


def test_a_cold_cache_starts_the_precompile_a_warm_one_does_not(sandbox, tmp_path):
    folder, calls = sandbox
    prefix = bytecode.enable(("fakepkg", "no_such_package"), workers=3)
    assert prefix == tmp_path / "cache" / "bytecode" and sys.pycache_prefix == str(prefix)
    assert not sys.dont_write_bytecode
    assert calls == [([folder], prefix, 3)]
    sys.pycache_prefix, sys.dont_write_bytecode = None, True
    assert bytecode.enable(("fakepkg",), workers=3) == prefix
    assert len(calls) == 1, "one pool a cache: the next process, still without torch's bytecode, starts none"
    sys.pycache_prefix, sys.dont_write_bytecode = str(prefix), False
    cached = Path(importlib.util.cache_from_source(str(folder / "__init__.py")))  # under the prefix
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")
    for marker in prefix.glob("precompile-*"):
        marker.unlink()
    sys.pycache_prefix, sys.dont_write_bytecode = None, True
    assert bytecode.enable(("fakepkg",), workers=3) == prefix
    assert len(calls) == 1, "a warm cache starts none"


@pytest.mark.parametrize("case", ["python writes it", "user prefix", "switched off", "bytecode beside it", "not installed"])
def test_nothing_changes(sandbox, monkeypatch, case):
    folder, calls = sandbox
    package = "fakepkg"
    if case == "python writes it":
        monkeypatch.setattr(sys, "dont_write_bytecode", False)
    elif case == "user prefix":
        monkeypatch.setattr(sys, "pycache_prefix", str(folder.parent / "mine"))
    elif case == "switched off":
        monkeypatch.setenv(bytecode.OFF, "0")
    elif case == "bytecode beside it":
        pyc = Path(importlib.util.cache_from_source(str(folder / "__init__.py")))
        pyc.parent.mkdir()
        pyc.write_bytes(b"")
    else:
        package = "no_such_package"
    before = (sys.pycache_prefix, sys.dont_write_bytecode)
    assert bytecode.enable((package,), workers=3) is None
    assert (sys.pycache_prefix, sys.dont_write_bytecode) == before and "PYTHONPYCACHEPREFIX" not in os.environ
    assert os.environ["PYTHONDONTWRITEBYTECODE"] == "1"
    assert calls == []


def test_precompile_compiles_every_module_into_the_prefix(tmp_path):
    folder = make_package(tmp_path / "pkgs")
    prefix = tmp_path / "cache"
    proc = bytecode.precompile([folder], prefix, workers=2)
    assert proc.wait(timeout=60) == 0
    tag = sys.implementation.cache_tag
    for source in ("__init__.py", "mod.py", "sub/__init__.py", "sub/deep.py"):
        path = folder / source
        cached = prefix / str(path.parent).lstrip(os.sep) / f"{path.stem}.{tag}.pyc"
        assert cached.is_file(), cached
    assert not any(p.name == "__pycache__" for p in folder.rglob("*"))
    assert bytecode.precompile([folder], prefix, workers=1) is None  # no pool beside a lone core


def test_the_hivetune_command_keeps_torch_bytecode(tmp_path):
    """`python -m hivetune` enables the cache before its command runs (here --help, beside a
    stand-in torch without bytecode)."""
    make_package(tmp_path / "pkgs", "torch")
    code = ("import runpy, sys; sys.argv = ['hivetune', '--help']\n"
            "try:\n    runpy.run_module('hivetune', run_name='__main__')\n"
            "except SystemExit:\n    pass\n")
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HIVETUNE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "pkgs"), SRC]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: hivetune" in out.stdout, out.stderr
    assert (tmp_path / "cache" / "bytecode").is_dir()
