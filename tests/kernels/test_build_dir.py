import os
import time
from pathlib import Path

import servelab.kernels as kernels
from servelab.kernels import (HEADERS, SOURCES, STALE_LOCK_S, _break_stale_lock, _build_dir, _build_name, _staged_sources,
                              kernels_root)


def test_checkouts_with_the_same_sources_share_one_build_folder(tmp_path):
    here = Path(kernels.__file__).parent
    for name in SOURCES + HEADERS:
        (tmp_path / "checkout_b").mkdir(exist_ok=True)
        (tmp_path / "checkout_b" / name).write_bytes((here / name).read_bytes())
    name = _build_name(here)
    assert _build_name(tmp_path / "checkout_b") == name
    assert _build_dir(tmp_path, name) == tmp_path / name
    (tmp_path / "checkout_b" / "ops.h").write_bytes(b"// changed\n" + (here / "ops.h").read_bytes())
    assert _build_name(tmp_path / "checkout_b") != name  # a header change is a new build


def test_the_build_compiles_one_staged_copy_of_the_sources(tmp_path):
    here = Path(kernels.__file__).parent
    build_dir = tmp_path / "kernels" / "servelab_cpu_ops_x"
    build_dir.mkdir(parents=True)
    staged = _staged_sources(build_dir, here)
    assert staged == build_dir / "src"
    assert sorted(p.name for p in staged.iterdir()) == sorted(SOURCES + HEADERS)
    assert all((staged / f).read_bytes() == (here / f).read_bytes() for f in SOURCES + HEADERS)
    stamp = (staged / "ops.h").stat().st_mtime_ns
    assert _staged_sources(build_dir, tmp_path / "elsewhere") == staged  # staged once; another checkout reuses it
    assert (staged / "ops.h").stat().st_mtime_ns == stamp
    assert [p.name for p in build_dir.iterdir()] == ["src"]  # no temporary folder left behind


def test_only_an_old_lock_is_broken(tmp_path: Path):
    lock = tmp_path / "lock"
    lock.write_text("")
    _break_stale_lock(tmp_path)
    assert lock.exists()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    _break_stale_lock(tmp_path)
    assert not lock.exists()
    _break_stale_lock(tmp_path)  # no lock at all is fine


def test_the_kernels_folder_is_one_spelling_of_one_place(tmp_path, monkeypatch):
    """A symlinked cache root and an explicit SERVELAB_KERNELS_DIR name the resolved folder, so every process
    writes the same absolute paths into build.ninja and none recompiles another's build."""
    real = tmp_path / "real"
    (real / "kernels").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.delenv("SERVELAB_KERNELS_DIR", raising=False)
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "link"))
    assert kernels_root() == real / "kernels"
    monkeypatch.setenv("SERVELAB_KERNELS_DIR", str(tmp_path / "link" / "kernels"))
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert kernels_root() == real / "kernels"
