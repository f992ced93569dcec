"""The documentation stays true: the site builds with --strict (no broken link or anchor), the README stays a short
user README without history, and the architecture page names only files that exist and lists the layers of
pyproject.toml's import-linter contract."""
import os
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
MAX_README_LINES = 300

# History belongs in git: no session numbers, no branch names, no result folders with session suffixes, no trial dates.
HISTORY_MARKERS = {
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "a branch": re.compile(r"\bbranch(es)?\b|\b(calib|simday|simspeed)\d*\b|\b(tpnodes|servepath)\b", re.IGNORECASE),
    "a session suffix": re.compile(r"-s\d+[a-z]?\b"),
    "'previously'": re.compile(r"\bpreviously\b", re.IGNORECASE),
}
TRIAL_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")

# `servelab/core/plan.py`, `src/servelab/kernels/`, ...; and dotted modules such as `servelab.lab.sim`.
FILE_PATH = re.compile(r"(?<![\w/.])(?:src/)?(servelab/[\w/]*[\w.]*\w/?)")
MODULE = re.compile(r"(?<![\w/.])servelab(?:\.[a-z_][a-z0-9_]*)+")
# The scripts a figure's command runs: `python benchmarks/soak/run.py`, `tests/integration/...py`.
SCRIPT = re.compile(r"(?<![\w/.])((?:benchmarks|tests)/[\w/.-]+\.(?:py|sh))")


def history_in(text: str, with_dates: bool) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in HISTORY_MARKERS.items():
            match = pattern.search(line)
            if match:
                found.append(f"line {number}: {name} ({match.group(0)!r})")
        if with_dates and TRIAL_DATE.search(line):
            found.append(f"line {number}: a date ({TRIAL_DATE.search(line).group(0)!r})")
    return found


def architecture_paths(text: str) -> tuple[list[str], list[str]]:
    """The file paths (relative to src/) and dotted module names the page names, each once, in page order."""
    paths = list(dict.fromkeys(m.group(1).rstrip(".") for m in FILE_PATH.finditer(text)))
    modules = list(dict.fromkeys(m.group(0) for m in MODULE.finditer(text)))
    return paths, modules


def module_exists(dotted: str) -> bool:
    base = ROOT / "src" / Path(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir()


def test_site_builds_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_every_page_is_in_the_nav():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert pages, "docs/ has no pages"
    assert [p for p in pages if f": {p}" not in config] == []


def test_readme_is_a_short_user_readme():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert text.index("make run") < text.index("## "), "the README starts with the commands a new user types"
    assert "make test" in text.split("## ")[0]
    assert history_in(text, with_dates=True) == []


def test_docs_hold_no_history():
    found = {page.name: history_in(page.read_text(), with_dates=False) for page in sorted(DOCS.glob("*.md"))}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_history_markers_are_caught():
    text = "measured in session 13 on branch simday2 (benchmarks/results/peers-smollm2-s13/), 2026-12-04"
    assert len(history_in(text, with_dates=True)) == 4
    assert history_in("the scheduler's waiting queue, 42 tok/s at -tp 3", with_dates=True) == []


def test_architecture_page_names_only_existing_files():
    """When a file moves, this lists every path on the page that no longer exists, so the page can be fixed in one go."""
    paths, modules = architecture_paths(ARCHITECTURE.read_text())
    assert len(paths) > 40, "the request lifecycle names each file it passes through"
    missing = [p for p in paths if not (ROOT / "src" / p).exists()]
    missing += [m for m in modules if not module_exists(m)]
    assert missing == [], "docs/architecture.md names paths that do not exist:\n" + "\n".join(missing)


def test_commands_name_existing_scripts():
    """Every figure's command runs a script that exists; when benchmarks move, this lists the commands to fix."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    missing = sorted({f"{page.name}: {m.group(1)}" for page in pages for m in SCRIPT.finditer(page.read_text())
                      if not (ROOT / m.group(1)).is_file()})
    assert missing == [], "scripts named in the documentation that do not exist:\n" + "\n".join(missing)


def test_architecture_paths_are_recognised():
    paths, modules = architecture_paths("`servelab/core/plan.py`, `src/servelab/kernels/` and servelab.lab.sim; "
                                        "`servelab/engine/async_llm.py`.")
    assert paths == ["servelab/core/plan.py", "servelab/kernels/", "servelab/engine/async_llm.py"]
    assert modules == ["servelab.lab.sim"]


def test_architecture_page_lists_the_layer_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    lines = [line.strip() for line in ARCHITECTURE.read_text().splitlines()]
    missing = [layer for layer in layers if layer not in lines]
    assert missing == [], f"layers of pyproject.toml not listed on docs/architecture.md: {missing}"
    positions = [lines.index(layer) for layer in layers]
    assert positions == sorted(positions), "docs/architecture.md lists the layers in another order than pyproject.toml"
