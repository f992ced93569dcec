"""tests/ mirrors src/servelab/: each folder of tests is a package of servelab (integration/ runs real servers and
architecture/ checks the package's shape; data/ folders hold a test's files)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOT_PACKAGES = {"integration", "architecture", "data", "__pycache__"}


def unmirrored(tests: Path, package: Path) -> list[str]:
    """The folders under tests that name no package under package."""
    return sorted(str(d.relative_to(tests)) for d in tests.rglob("*") if d.is_dir()
                  and not NOT_PACKAGES & set(d.relative_to(tests).parts)
                  and not (package / d.relative_to(tests) / "__init__.py").is_file())


def test_every_test_folder_is_a_package_of_servelab():
    assert unmirrored(ROOT / "tests", ROOT / "src" / "servelab") == []


def test_a_folder_with_no_package_is_found(tmp_path):
    (tmp_path / "src" / "core").mkdir(parents=True)
    (tmp_path / "src" / "core" / "__init__.py").write_text("")
    for folder in ("core", "web", "integration/x", "core/data"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
    assert unmirrored(tmp_path / "tests", tmp_path / "src") == ["web"]


def same_basenames(tests: Path) -> dict[str, list[str]]:
    """Test modules that share a file name: pytest's default (rootdir) import mode imports both as one module
    name, so the second fails to collect with 'import file mismatch' in a clean checkout."""
    seen: dict[str, list[str]] = {}
    for f in sorted(tests.rglob("test_*.py")):
        seen.setdefault(f.name, []).append(str(f.relative_to(tests)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_test_modules_have_unique_names():
    assert same_basenames(ROOT / "tests") == {}


def test_a_repeated_test_module_name_is_found(tmp_path):
    for folder in ("core", "engine"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_x.py").write_text("")
    (tmp_path / "core" / "test_y.py").write_text("")
    assert same_basenames(tmp_path) == {"test_x.py": ["core/test_x.py", "engine/test_x.py"]}
