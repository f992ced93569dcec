"""The real engine's step never loads the lab-only decode-run package (servelab/core/decode_runs/)."""
import subprocess
import sys

PROBE = """
import sys
from servelab.core.block_manager import BlockManager
from servelab.core.clock import WallClock
from servelab.core.engine_core import EngineCore
from servelab.core.scheduler import Scheduler
import servelab.engine.llm_engine, servelab.engine.async_llm
print(sorted(m for m in sys.modules if m.startswith("servelab.core.decode_runs")))
"""


def test_real_engine_modules_do_not_import_decode_runs():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_simulator_core_loads_decode_runs_when_asked():
    probe = PROBE.replace("import servelab.engine.llm_engine, servelab.engine.async_llm",
                          "from servelab.core.decode_runs.planner import DecodeRunPlanner")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert "servelab.core.decode_runs.planner" in out.stdout
