"""servelab's CPU ops (AVX2 + FMA), compiled on first use with torch.utils.cpp_extension and cached
per user. The PyTorch model code stays the reference; these are the fast path for bf16 weights."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
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


def _build_dir(root: Path, here: Path, name: str) -> Path:
    # build.ninja records absolute source paths, so two checkouts sharing one build folder would
    # rebuild each other's module on every load: key the folder by the source folder too.
    where = hashlib.sha256(str(here.resolve()).encode()).hexdigest()[:8]
    return root / "kernels" / f"{name}-{where}"


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
        root = Path(os.environ.get("SERVELAB_CACHE_DIR", Path.home() / ".cache" / "servelab"))
        cache = _build_dir(root, here, name)
        cache.mkdir(parents=True, exist_ok=True)
        _break_stale_lock(cache)
        return load(name=name, sources=[str(here / s) for s in SOURCES],
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    build_directory=str(cache), verbose=False)
    except Exception as exc:  # a missing compiler must not stop the engine, only slow bf16 down
        logger.warning("servelab CPU kernels unavailable (%s); using PyTorch ops", exc)
        return None


def linear_bf16w():
    ops = cpu_ops()
    return None if ops is None else ops.linear_bf16w
