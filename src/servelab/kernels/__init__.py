"""servelab's CPU ops (AVX2 + FMA), compiled on first use with torch.utils.cpp_extension and cached
per user, one build per version of the sources shared by every checkout. The PyTorch model code stays the reference; these are the fast path for bf16 weights."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)
SOURCES = ("bindings.cpp", "linear_bf16.cpp", "linear_quant.cpp", "cpu_ops.cpp", "decode_step.cpp", "int8_rows.cpp",
           "prefill_attention.cpp", "int8_gemm_rows.cpp", "w8a8_layers.cpp")
HEADERS = ("ops.h", "simd.h", "rowops.h", "gemv.h", "quant_blocks.h", "kv_cache.h", "q4_packed.h")


def _build_name(here: Path) -> str:
    # torch rebuilds when a listed source changes but not a header: name the build after them all.
    digest = hashlib.sha256(b"".join((here / f).read_bytes() for f in SOURCES + HEADERS)).hexdigest()
    return f"servelab_cpu_ops_{digest[:10]}"


def kernels_root() -> Path:
    """Where builds live: $SERVELAB_KERNELS_DIR, else $SERVELAB_CACHE_DIR/kernels (default ~/.cache/servelab/kernels),
    with symlinks resolved. build.ninja records the sources' absolute paths, so one build reached by two path
    spellings (a symlink, a second cache root) would be recompiled (about a minute) by every load that
    spells it differently from the last."""
    env = os.environ.get("SERVELAB_KERNELS_DIR")
    if env:
        return Path(env).expanduser().resolve()
    root = Path(os.environ.get("SERVELAB_CACHE_DIR", Path.home() / ".cache" / "servelab")).expanduser()
    return (root / "kernels").resolve()


def _build_dir(root: Path, name: str) -> Path:
    # named after the sources' contents only: every checkout with the same sources shares one build
    return root / name


def _staged_sources(build_dir: Path, here: Path) -> Path:
    """The sources and headers copied into the build folder once. build.ninja records absolute source paths:
    built from each checkout's own files, two checkouts sharing the folder would rebuild each other's module
    on every load; built from this copy, every checkout names the same files."""
    staged = build_dir / "src"
    if not all((staged / f).is_file() for f in SOURCES + HEADERS):
        tmp = Path(tempfile.mkdtemp(dir=build_dir, prefix="src-"))
        for f in SOURCES + HEADERS:
            shutil.copyfile(here / f, tmp / f)
        try:
            tmp.rename(staged)
        except OSError:  # another process staged them first
            shutil.rmtree(tmp, ignore_errors=True)
    return staged


STALE_LOCK_S = 600


def _break_stale_lock(build_dir: Path) -> None:
    # torch's FileBaton waits forever on a lock left by a build that was killed; no build takes
    # ten minutes, so an older lock is a leftover.
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing stale kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass


def _cpu_has_avx2_fma_f16c() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags and "f16c" in flags


@functools.lru_cache(maxsize=None)
def cpu_ops():
    """The compiled module, or None where it cannot be built (no AVX2/FMA, no C++ compiler, or
    SERVELAB_NO_KERNELS=1); callers then stay on PyTorch's own ops. The first build takes about a
    minute; later processes load the cached .so."""
    if os.environ.get("SERVELAB_NO_KERNELS") == "1" or not _cpu_has_avx2_fma_f16c():
        return None
    try:
        from torch.utils.cpp_extension import load

        here = Path(__file__).parent
        name = _build_name(here)
        cache = _build_dir(kernels_root(), name)
        cache.mkdir(parents=True, exist_ok=True)
        _break_stale_lock(cache)
        staged = _staged_sources(cache, here)
        return load(name=name, sources=[str(staged / s) for s in SOURCES],
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    build_directory=str(cache), verbose=False)
    except Exception as exc:  # a missing compiler must not stop the engine, only slow bf16 down
        logger.warning("servelab CPU kernels unavailable (%s); using PyTorch ops", exc)
        return None


def linear_bf16w():
    ops = cpu_ops()
    return None if ops is None else ops.linear_bf16w
