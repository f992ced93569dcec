"""The simulator's hot modules compiled to C with mypyc, used when built and current; pure Python otherwise.

`python -m servelab.compiled.build` (needs mypy and a C compiler; `make compiled`) compiles MODULES into
ext/ beside this file, with a manifest of each source's hash. Whether a process uses them is one explicit
switch, the environment variable SERVELAB_COMPILED, read once when the `servelab` package is imported (so
before any of MODULES, whatever the process imports first) and reported by `servelab --version`:

  0 (the default)  the sources run as Python
  auto             the build is used when there is a current one
  1                the build is used; without a current one the process says so on stderr and runs Python

A build is current when every listed source still has the hash it was compiled from (the modules are compiled
as one group, so one edited file turns the whole group off) and the interpreter is the one it was built for.
Then install() puts a finder in front of Python's own that loads those extension modules instead of the .py
files. Both give the same numbers (tests/compiled/test_compiled.py).
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

SWITCH = "SERVELAB_COMPILED"
MODES = ("0", "auto", "1")

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


def mode() -> str:
    value = os.environ.get(SWITCH, "0").strip().lower() or "0"
    if value not in MODES:
        print(f"servelab: {SWITCH}={value!r} is not one of {', '.join(MODES)}; taken as 0", file=sys.stderr)
        return "0"
    return value


def install() -> bool:
    """Load the compiled modules from now on, as SERVELAB_COMPILED says. servelab/__init__.py calls it, before
    any of MODULES can be imported; a later call changes nothing."""
    global _active
    if _active or mode() == "0":
        return _active
    files = usable_build()
    if files is None or any(m in sys.modules for m in MODULES):
        if mode() == "1":
            print(f"servelab: {SWITCH}=1 but there is no current compiled build in {EXT_DIR} "
                  "(`make compiled` makes one); running the Python sources", file=sys.stderr)
        return False
    sys.meta_path.insert(0, _CompiledFinder(files))
    _active = True
    return True


def active() -> bool:
    """Whether the compiled modules are in use in this process."""
    return _active


def describe() -> str:
    """One line for `servelab --version`."""
    if _active:
        return f"compiled lab modules: on ({SWITCH}={mode()}, {len(MODULES)} modules from {EXT_DIR})"
    if mode() == "0":
        return f"compiled lab modules: off ({SWITCH}=0; auto or 1 uses a current build)"
    return f"compiled lab modules: off ({SWITCH}={mode()}: no current build in {EXT_DIR})"
