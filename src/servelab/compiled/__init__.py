"""The simulator's hot modules compiled to C with mypyc, used when built and current; pure Python otherwise.

`python -m servelab.compiled.build` (needs mypy and a C compiler; `make compiled`) compiles MODULES into
ext/ beside this file, with a manifest of each source's hash. When servelab.lab is imported before any of
MODULES (the lab's processes; never the serving engine's: servelab/lab/__init__.py), install() puts
a finder in front of Python's own that loads those extension modules instead of the .py files, but only
if every listed source still has the hash it was compiled from (the modules are compiled as one group,
so one edited file turns the whole group off) and the interpreter is the one they were built for.
Otherwise, or with SERVELAB_PURE=1 (the test suite sets it), nothing changes: the same sources run as Python. Both give the
same numbers (tests/compiled/test_compiled.py).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path

# The simulator's per-step path: engine core, scheduler, block manager, decode runs, cost model, instance
# bookkeeping and the event loop. Not engine_io.py (msgspec structs shared with engine processes).
MODULES = (
    "servelab.core.block_hash", "servelab.core.block_manager", "servelab.core.clock", "servelab.core.decode_runs.batch",
    "servelab.core.decode_runs.planner", "servelab.core.decode_runs.run_states", "servelab.core.engine_core",
    "servelab.core.plan", "servelab.core.prefix_cache", "servelab.core.request", "servelab.core.scheduler",
    "servelab.executor.cost_model", "servelab.executor.cost_model_executor", "servelab.executor.efficiency",
    "servelab.lab.sim.finished", "servelab.lab.sim.instance", "servelab.lab.sim.load_balancer",
    "servelab.lab.sim.simulate", "servelab.lab.sim.step_log",
)
# SERVELAB_COMPILED_DIR: another build folder (tests build into a temporary one)
EXT_DIR = Path(os.environ.get("SERVELAB_COMPILED_DIR") or Path(__file__).parent / "ext")
MANIFEST = "manifest.json"
SRC_ROOT = Path(__file__).resolve().parents[2]  # the folder holding servelab/

_active = False


def source_path(module: str) -> Path:
    return SRC_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_hashes() -> dict[str, str]:
    return {m: hashlib.sha256(source_path(m).read_bytes()).hexdigest() for m in MODULES}


def interpreter_tag() -> str:
    return f"{sys.implementation.cache_tag} {importlib.machinery.EXTENSION_SUFFIXES[0]}"


class _CompiledFinder:
    """Finds the compiled extension of each built module (and the group's shared library)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def find_spec(self, fullname, path=None, target=None):
        file = self.files.get(fullname)
        if file is None:
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(file))
        return importlib.util.spec_from_file_location(fullname, file, loader=loader)


def usable_build(ext_dir: Path = EXT_DIR) -> dict[str, Path] | None:
    """The extension files of a build that matches the sources and this interpreter, by module; else None."""
    try:
        manifest = json.loads((ext_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("interpreter") != interpreter_tag() or manifest.get("sources") != source_hashes():
        return None
    files = {name: ext_dir / file for name, file in manifest["files"].items()}
    return files if all(f.is_file() for f in files.values()) else None


def install() -> bool:
    """Load the compiled modules from now on, when a current build exists and SERVELAB_PURE is unset.
    Call before any of MODULES is imported (servelab/lab/__init__.py does); after, it does nothing."""
    global _active
    if _active or os.environ.get("SERVELAB_PURE", "0") != "0":
        return _active
    files = usable_build()
    if files is None or any(m in sys.modules for m in MODULES):
        return False
    sys.meta_path.insert(0, _CompiledFinder(files))
    _active = True
    return True


def active() -> bool:
    """Whether the compiled modules are in use in this process."""
    return _active
