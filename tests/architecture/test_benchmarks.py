"""benchmarks/ holds one folder per topic, each with its run.py and a README, and no benchmark reaches into tests/:
what benchmarks and tests share lives in servelab/testing/."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TESTS_PATH = re.compile(r"""["'/]tests["'/]""")


def reaches_into_tests(source: str) -> list[str]:
    """The imports of tests' modules, and the strings that name the tests folder (a sys.path entry, a script path)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in ("tests", "conftest")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("tests", "conftest"):
            found.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TESTS_PATH.search(f"/{node.value}/"):
            found.append(repr(node.value))
    return found


def test_no_benchmark_imports_from_tests():
    found = {str(p.relative_to(ROOT)): hits for p in sorted(BENCHMARKS.rglob("*.py"))
             if (hits := reaches_into_tests(p.read_text()))}
    assert found == {}


def test_the_check_catches_each_way_into_tests():
    assert reaches_into_tests("from tests.gateway import soak") == ["tests.gateway"]
    assert reaches_into_tests("import conftest") == ["conftest"]
    assert reaches_into_tests('sys.path.insert(0, str(REPO / "tests" / "gateway"))') == ["'tests'"]
    assert reaches_into_tests('run(["python", "tests/gateway/stub_server.py"])') == ["'tests/gateway/stub_server.py'"]
    assert reaches_into_tests("from servelab.testing.soak import run_soak\nlatest = 'the tests pass'") == []


def test_one_folder_per_topic_with_run_py_and_readme():
    """A topic: run.py, README.md and its latest result. A folder without Python holds data the benchmarks replay
    (benchmarks/traces) and says what it is in its README."""
    entries = sorted(BENCHMARKS.iterdir())
    assert [p.name for p in entries if not p.is_dir()] == [], "benchmarks/ holds only topic folders"
    assert [p.name for p in entries if not (p / "README.md").is_file()] == []
    assert [p.name for p in entries if any(p.rglob("*.py")) and not (p / "run.py").is_file()] == []
