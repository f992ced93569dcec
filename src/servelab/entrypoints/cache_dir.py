"""The cache folder (converted GGUF models, built kernels) must be writable before anything is loaded, so
that a full disk or a read-only folder is one clear line at start, not a traceback from deep inside a
conversion or a compiler run."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

PROBE_BYTES = 64 * 1024


def servelab_cache_dir() -> Path:
    env = os.environ.get("SERVELAB_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "servelab"


def check_cache_dir(folder: Path | None = None) -> Path:
    """Create the folder if needed and write (then remove) a probe file in it; ValueError saying which folder
    and why (no space, read-only, not a folder) when that fails."""
    folder = folder or servelab_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-probe-") as probe:
            probe.write(b"\0" * PROBE_BYTES)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        raise ValueError(f"the cache folder {folder} is not usable ({exc.strerror or exc}); free some space "
                         "there or point SERVELAB_CACHE_DIR at a writable folder") from exc
    return folder
