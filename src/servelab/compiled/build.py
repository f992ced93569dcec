"""Compile servelab.compiled.MODULES with mypyc into servelab/compiled/ext (see __init__.py).

    python -m servelab.compiled.build     (or: make compiled)

Needs mypy (which ships mypyc) and a C compiler; about a minute of CPU. Without them it says so and
exits 1: servelab runs the same sources as Python.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from servelab.compiled import EXT_DIR, MANIFEST, MODULES, SRC_ROOT, interpreter_tag, source_hashes, source_path

GROUP = "servelab_compiled"
# mypy options: the compiled modules are checked together; what else they import is taken as Any (numpy and
# torch would take minutes to analyse)
MYPY_FLAGS = ["--ignore-missing-imports", "--follow-imports=skip"]


def build(ext_dir: Path = EXT_DIR, opt_level: str = "3") -> dict[str, str]:
    """Compile MODULES into ext_dir (replacing what was there); returns module -> file, relative to it.
    opt_level is the C compiler's (-O3 for speed; the tests build at 0, which compiles several times faster
    and computes the same bytes: mypyc's C uses no fast-math)."""
    from mypyc.build import mypycify
    from setuptools import Distribution

    hashes = source_hashes()  # before compiling: an edit meanwhile leaves the build unused, not wrong
    paths = [str(source_path(m).relative_to(SRC_ROOT)) for m in MODULES]
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(SRC_ROOT)  # mypyc names modules by their paths from here
        try:
            flags = MYPY_FLAGS + [f"--cache-dir={os.path.join(tmp, 'mypy-cache')}"]  # nothing left in src/
            extensions = mypycify(flags + paths, opt_level=opt_level, group_name=GROUP,
                                  target_dir=os.path.join(tmp, "c"))
            dist = Distribution({"name": GROUP, "ext_modules": extensions})
            command = dist.get_command_obj("build_ext")
            command.build_lib, command.build_temp = os.path.join(tmp, "lib"), os.path.join(tmp, "obj")
            dist.run_command("build_ext")
        finally:
            os.chdir(cwd)
        lib = Path(tmp, "lib")
        files = {}
        for so in lib.rglob("*.so"):
            relative = so.relative_to(lib)
            module = ".".join(relative.parts[:-1] + (relative.name.split(".")[0],))
            files[module] = str(relative)
        if sorted(set(files) - {f"{GROUP}__mypyc"}) != sorted(MODULES):
            raise RuntimeError(f"mypyc built {sorted(files)}, expected {sorted(MODULES)} and the group library")
        shutil.rmtree(ext_dir, ignore_errors=True)
        shutil.copytree(lib, ext_dir)
    (ext_dir / MANIFEST).write_text(json.dumps({"interpreter": interpreter_tag(), "sources": hashes, "files": files},
                                               indent=1) + "\n")
    return files


def main() -> int:
    try:
        import mypyc  # noqa: F401
    except ImportError:
        print("servelab.compiled.build: mypy (mypyc) is not installed; the simulator stays pure Python", file=sys.stderr)
        return 1
    try:
        files = build()
    except Exception as error:  # no compiler, a type error: say so, keep the pure-Python path
        print(f"servelab.compiled.build: failed ({error}); the simulator stays pure Python", file=sys.stderr)
        return 1
    print(f"servelab.compiled.build: {len(files) - 1} modules compiled into {EXT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
