"""The simulator's optional mypyc build (servelab/compiled): used only when switched on (SERVELAB_COMPILED,
reported by `servelab --version`) and current, whatever the process imports first, and it changes no byte.

The build is taken only when every compiled module's source still has the hash it was built from and the
interpreter matches; otherwise the same sources run as Python. Compiled, the golden simulations, the
multi-step and run-horizon checks give exactly what pure Python gives (they run again in a subprocess
on a fresh build; skipped where mypy, which ships mypyc, is not installed).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servelab import compiled

ROOT = Path(__file__).resolve().parents[2]


def _fake_build(ext_dir: Path, **changes) -> None:
    files = {m: f"{m}.so" for m in compiled.MODULES}
    for file in files.values():
        (ext_dir / file).write_bytes(b"")
    manifest = {"interpreter": compiled.interpreter_tag(), "sources": compiled.source_hashes(), "files": files}
    manifest.update(changes)
    (ext_dir / compiled.MANIFEST).write_text(json.dumps(manifest))


def test_a_current_build_is_used(tmp_path):
    _fake_build(tmp_path)
    files = compiled.usable_build(tmp_path)
    assert files == {m: tmp_path / f"{m}.so" for m in compiled.MODULES}


def test_an_edited_source_turns_the_whole_build_off(tmp_path):
    hashes = compiled.source_hashes()
    hashes["servelab.core.engine_core"] = "0" * 64
    _fake_build(tmp_path, sources=hashes)
    assert compiled.usable_build(tmp_path) is None


def test_another_interpreter_or_a_missing_file_or_no_build_is_not_used(tmp_path):
    _fake_build(tmp_path, interpreter="cpython-39 .so")
    assert compiled.usable_build(tmp_path) is None
    _fake_build(tmp_path)
    (tmp_path / "servelab.core.scheduler.so").unlink()
    assert compiled.usable_build(tmp_path) is None
    assert compiled.usable_build(tmp_path / "absent") is None


def test_every_compiled_module_has_a_source():
    assert all(compiled.source_path(m).is_file() for m in compiled.MODULES)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    pytest.importorskip("mypyc")
    from servelab.compiled.build import build

    ext_dir = tmp_path_factory.mktemp("compiled")
    build(ext_dir, opt_level="0")  # what is checked is the switch and the bytes, not the speed
    return ext_dir


def _run(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **env}, check=True)
    return out.stdout


def _cli_version(**env) -> str:
    return _run("from servelab.entrypoints.cli import main; main(['--version'])", **env)


def test_the_switch_is_off_by_default_and_says_so_without_a_build(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SERVELAB_COMPILED"}
    out = subprocess.run([sys.executable, "-c", "import servelab.compiled as c, servelab.core.scheduler;"
                          "print(c.mode(), c.active())"], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    assert out.stdout.split() == ["0", "False"]
    assert "compiled lab modules: off (SERVELAB_COMPILED=0" in _cli_version(SERVELAB_COMPILED="0")
    assert "off (SERVELAB_COMPILED=auto: no current build" in _cli_version(SERVELAB_COMPILED="auto",
                                                                           SERVELAB_COMPILED_DIR=str(tmp_path))


def test_the_switch_turns_the_build_on_whatever_is_imported_first(build_dir):
    """The engine first (as an engine core or LLM does) or the lab first: the switch alone decides."""
    for first in ("servelab.engine.llm_engine", "servelab.lab.sim.simulate"):
        code = (f"import {first}, servelab.compiled as c, servelab.core.scheduler as s;"
                "print(c.active(), s.__file__.endswith('.so'))")
        for switch, expected in (("1", ["True", "True"]), ("auto", ["True", "True"]), ("0", ["False", "False"])):
            assert _run(code, SERVELAB_COMPILED_DIR=str(build_dir), SERVELAB_COMPILED=switch).split() == expected
    assert "compiled lab modules: on (SERVELAB_COMPILED=1" in _cli_version(SERVELAB_COMPILED_DIR=str(build_dir),
                                                                           SERVELAB_COMPILED="1")


def test_golden_and_multi_step_checks_pass_compiled(build_dir):
    # byte-identical to the recorded pure-Python output (test_simulate_golden), and single steps
    # against runs (test_multi_step, test_run_horizon), all with the compiled modules; not the one that
    # patches a method of DecodeBatch (a compiled class's methods are fixed)
    tests = ["tests/lab/sim/test_simulate_golden.py", "tests/core/decode_runs/test_multi_step.py",
             "tests/lab/sim/test_run_horizon.py"]
    # the build is in use before pytest's conftest imports anything (checked)
    code = ("import sys, servelab.compiled as c; assert c.active(); import pytest;"
            f"sys.exit(pytest.main(['-x', '-q', '-o', 'addopts=', '-p', 'no:cacheprovider', *{tests!r},"
            "'-k', 'not trimmed_step_ends']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "SERVELAB_COMPILED_DIR": str(build_dir), "SERVELAB_COMPILED": "1"})
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout
