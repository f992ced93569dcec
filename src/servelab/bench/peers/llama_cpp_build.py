"""llama.cpp's tools for `servelab bench peers`, built from source: the llama-cpp-python source
distribution on PyPI vendors llama.cpp (vendor/llama.cpp), so pip is the only network this needs.

The build goes to $SERVELAB_CACHE_DIR/peers/llama.cpp-<version>/ (default ~/.cache/servelab/...), once:
a finished build (every tool present) is reused.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the newest sdist on PyPI when this was written; pinned for reproducibility
TOOLS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize")
# Offline, CPU-only, static tools: no curl/openssl, no web UI (its prebuilt assets are downloaded from
# Hugging Face), no tests or examples.
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")


class BuildError(ValueError):
    """A ValueError so that the command line prints it as one line (servelab: error: ...)."""


@dataclass(frozen=True)
class LlamaCppTools:
    bin_dir: Path

    def path(self, tool: str) -> Path:
        return self.bin_dir / tool

    def missing(self) -> list[str]:
        return [t for t in TOOLS if not os.access(self.path(t), os.X_OK)]


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    env = os.environ.get("SERVELAB_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "servelab"
    return root / "peers" / f"llama.cpp-{version}"


def check_toolchain(which=None) -> None:
    """cmake and a C/C++ compiler, or a BuildError that names the package to install."""
    which = which or shutil.which
    wanted = {"cmake": "cmake (apt-get install cmake, or pip install cmake)",
              "c++": "a C++ compiler (apt-get install g++ / build-essential)",
              "cc": "a C compiler (apt-get install gcc / build-essential)"}
    found = {"cmake": which("cmake"), "c++": which("c++") or which("g++") or which("clang++"),
             "cc": which("cc") or which("gcc") or which("clang")}
    missing = [wanted[k] for k, v in found.items() if not v]
    if missing:
        raise BuildError("building llama.cpp needs " + " and ".join(missing) + "; install it, or pass "
                         "--llama-cpp-dir DIR (a folder with llama-server etc.), or --only servelab,hf")


def download_command(version: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            f"llama-cpp-python=={version}", "--dest", str(dest)]


def configure_command(source_dir: Path, build_dir: Path) -> list[str]:
    return ["cmake", "-S", str(source_dir), "-B", str(build_dir), *CMAKE_OPTIONS]


def build_command(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--config", "Release", f"-j{jobs}", "--target", *TOOLS]


def _run(command: list[str], log) -> None:
    print("+ " + shlex.join(command), flush=True)
    log.write(f"+ {shlex.join(command)}\n")
    log.flush()
    result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode:
        raise BuildError(f"`{shlex.join(command)}` failed with exit status {result.returncode}; "
                         f"see {log.name}")


def unpack_sdist(download_dir: Path, version: str, root: Path) -> Path:
    archives = sorted(download_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not archives:
        raise BuildError(f"pip download left no llama_cpp_python-{version}.tar.gz in {download_dir}")
    with tarfile.open(archives[0]) as tar:
        tar.extractall(root, filter="data")
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        raise BuildError(f"{archives[0]} has no vendor/llama.cpp/CMakeLists.txt")
    return source


def ensure_llama_cpp(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None,
                     root: Path | None = None) -> LlamaCppTools:
    """The built tools, building them first unless a finished build is already in the cache."""
    root = root or cache_dir(version)
    tools = LlamaCppTools(root / "build" / "bin")
    if not tools.missing():
        print(f"llama.cpp: reusing the build in {root}", flush=True)
        return tools
    check_toolchain()
    jobs = jobs or max(1, min(os.cpu_count() or 1, 8))
    root.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: building {', '.join(TOOLS)} from llama-cpp-python {version}'s source into {root} "
          f"(minutes; log: {root / 'build.log'})", flush=True)
    with open(root / "build.log", "a") as log:
        source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            _run(download_command(version, root / "sdist"), log)
            source = unpack_sdist(root / "sdist", version, root)
        _run(configure_command(source, root / "build"), log)
        _run(build_command(root / "build", jobs), log)
    if tools.missing():
        raise BuildError(f"the build finished but {', '.join(tools.missing())} are missing in {tools.bin_dir}")
    return tools


def existing_tools(directory: Path) -> LlamaCppTools:
    """--llama-cpp-dir: a folder with the tools, or a llama.cpp build folder (tools in bin/)."""
    for bin_dir in (directory, directory / "bin", directory / "build" / "bin"):
        tools = LlamaCppTools(bin_dir)
        if not tools.missing():
            return tools
    raise BuildError(f"--llama-cpp-dir {directory}: no {', '.join(TOOLS)} found there or in bin/ or build/bin/")
