"""The quantization figures in one run (docs/precision.md). Single-stream decode: llama.cpp's llama-bench tg128 on
the default GGUF (Q4_1, when a llama.cpp build is there) beside servelab's bf16 and --quantization gguf; batched
decode: 64 x (128 in, 64 out) per precision; perplexity last. Writes its results here.

    python benchmarks/quant/run.py      (on a quiet machine; LLAMA_CPP_BIN=folder of llama-bench, THREADS=n)
"""
import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
CLI = [sys.executable, "-m", "servelab.entrypoints.cli"]
LLAMA_CPP_BIN = Path.home() / ".cache/servelab/peers/llama.cpp-0.3.36/build/bin"


def cli(*args: str) -> None:
    subprocess.run([*CLI, *args, "--result-dir", str(HERE)], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    from servelab.model.loader import default_gguf_path

    threads = os.environ.get("THREADS", str(os.cpu_count()))
    llama_bench = Path(os.environ.get("LLAMA_CPP_BIN", LLAMA_CPP_BIN), "llama-bench")
    print("load before:", os.getloadavg())
    for rep in (1, 2, 3):
        if os.access(llama_bench, os.X_OK):
            with open(HERE / f"llama-bench-tg128-q4_1-rep{rep}.json", "w") as out:
                subprocess.run([str(llama_bench), "-m", str(default_gguf_path()), "-p", "0", "-n", "128", "-t",
                                threads, "-fa", "on", "-r", "3", "-o", "json"], stdout=out, check=True)
        for q in ("none", "gguf"):
            quant = ["--quantization", q] if q != "none" else []
            cli("bench", "latency", "--batch-size", "1", "--input-len", "32", "--output-len", "128", "--num-iters", "3",
                *quant, "--name", f"latency-b1-{q}-rep{rep}")
    for q in ("none", "gguf", "int8"):
        quant = ["--quantization", q] if q != "none" else []
        cli("bench", "latency", "--batch-size", "64", "--input-len", "128", "--output-len", "64", "--num-iters", "2",
            *quant, "--name", f"latency-b64-{q}")
    print("load after decode runs:", os.getloadavg())
    cli("bench", "perplexity", "--name", "perplexity-smollm2")
    print("load after:", os.getloadavg())


if __name__ == "__main__":
    main()
