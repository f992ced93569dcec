"""llama.cpp's tools for `servelab bench peers`, built from source: the llama-cpp-python source
distribution on PyPI vendors llama.cpp (vendor/llama.cpp), so pip is the only network this needs.

The build goes to $SERVELAB_CACHE_DIR/peers/llama.cpp-<version>/ (default ~/.cache/servelab/...), once:
a finished build (every tool present) is reused.

It is built for this CPU (GGML_NATIVE), then tried on the default model's GGUF (llama-bench, a few tokens). On some
virtual machines the CPU advertises AMX but ggml's AMX matrix kernels die there with an illegal instruction
(SIGILL at `tilezero`): then a second build without AMX (`-mno-amx-*`, every other native instruction kept) goes
to build-noamx/ and is the one used; the result's `llama_cpp.build` says which and why.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
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


# The variants, tried in order: (build folder, extra cmake options, why it exists).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* flags win over -march=native's
VARIANTS = (("build", (), "native"),
            ("build-noamx", (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"),
             "native without AMX: the native build died with SIGILL in ggml's AMX kernels on this CPU"))


class BuildError(ValueError):
    """A ValueError so that the command line prints it as one line (servelab: error: ...)."""


@dataclass(frozen=True)
class LlamaCppTools:
    bin_dir: Path
    build: str = "given"  # which build (VARIANTS' description), or "given" for --llama-cpp-dir

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


def configure_command(source_dir: Path, build_dir: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return ["cmake", "-S", str(source_dir), "-B", str(build_dir), *CMAKE_OPTIONS, *extra]


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


def dies_of_sigill(tools: LlamaCppTools, gguf: Path) -> bool:
    """A few tokens of llama-bench on gguf (its quantized matrix kernels, AMX's included where built, on as many
    threads as the runs use): True when
    the process dies of an illegal instruction. Any other failure is left to the real runs to report."""
    # every core's thread: ggml's AMX path died only in its worker threads (-t 1 ran)
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    command = [str(tools.path("llama-bench")), "-m", str(gguf), "-p", "32", "-n", "4", "-r", "1", "-t", str(threads)]
    try:
        result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode in (-signal.SIGILL, 128 + signal.SIGILL)


def _build(root: Path, folder: str, extra: tuple[str, ...], version: str, jobs: int, log) -> None:
    source = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        _run(download_command(version, root / "sdist"), log)
        source = unpack_sdist(root / "sdist", version, root)
    _run(configure_command(source, root / folder, extra), log)
    _run(build_command(root / folder, jobs), log)


def ensure_llama_cpp(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None,
                     root: Path | None = None, gguf: Path | None = None, allow_build: bool = True) -> LlamaCppTools:
    """The built tools, building them first unless a finished build is already in the cache (or, without
    allow_build, a BuildError); with gguf, the first variant (VARIANTS) that does not die of SIGILL on it."""
    root = root or cache_dir(version)
    jobs = jobs or max(1, min(os.cpu_count() or 1, 8))
    for folder, extra, why in VARIANTS:
        tools = LlamaCppTools(root / folder / "bin", why)
        if not tools.missing():
            print(f"llama.cpp: reusing the build in {root / folder}", flush=True)
        elif not allow_build:
            raise BuildError(f"--skip-build: no finished llama.cpp build in {root / folder} (missing "
                             f"{', '.join(tools.missing())}); run once without --skip-build or pass --llama-cpp-dir")
        else:
            check_toolchain()
            root.mkdir(parents=True, exist_ok=True)
            print(f"llama.cpp: building {', '.join(TOOLS)} ({why}) from llama-cpp-python {version}'s source into "
                  f"{root / folder} (minutes; log: {root / 'build.log'})", flush=True)
            with open(root / "build.log", "a") as log:
                _build(root, folder, extra, version, jobs, log)
            if tools.missing():
                raise BuildError(f"the build finished but {', '.join(tools.missing())} are missing in "
                                 f"{tools.bin_dir}")
        if gguf is None or not dies_of_sigill(tools, gguf):
            return tools
        print(f"llama.cpp: the build in {root / folder} dies with SIGILL (illegal instruction) on this CPU", flush=True)
    raise BuildError(f"every llama.cpp build in {root} dies with SIGILL on this CPU; pass --llama-cpp-dir DIR "
                     "with tools built for it, or --only servelab,hf")


def existing_tools(directory: Path) -> LlamaCppTools:
    """--llama-cpp-dir: a folder with the tools, or a llama.cpp build folder (tools in bin/)."""
    for bin_dir in (directory, directory / "bin", directory / "build" / "bin"):
        tools = LlamaCppTools(bin_dir)
        if not tools.missing():
            return tools
    raise BuildError(f"--llama-cpp-dir {directory}: no {', '.join(TOOLS)} found there or in bin/ or build/bin/")
