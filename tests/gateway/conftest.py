import sys
from pathlib import Path

# The gateway tests run a real LLMEngine over the stub executor in tests/engine/stub_engine.py.
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
