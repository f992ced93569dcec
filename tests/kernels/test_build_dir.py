import os
import time
from pathlib import Path

from servelab.kernels import STALE_LOCK_S, _break_stale_lock, _build_dir


def test_two_checkouts_get_their_own_build_folder(tmp_path):
    a = _build_dir(tmp_path, tmp_path / "checkout_a", "servelab_cpu_ops_x")
    b = _build_dir(tmp_path, tmp_path / "checkout_b", "servelab_cpu_ops_x")
    assert a != b and a.parent == b.parent == tmp_path / "kernels"
    assert a == _build_dir(tmp_path, tmp_path / "checkout_a", "servelab_cpu_ops_x")


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
