"""`servelab serve` with no flags, from process start to ready (/health 200) and to the first streamed token of one
request: from an empty cache folder (the GGUF conversion, the CPU kernels' compile, int8 calibration), with only the
int8 entries removed (calibration and quantization, nothing else), and a warm restart (everything cached).

    python benchmarks/startup/run.py                     # all three, into benchmarks/startup/result.json
    python benchmarks/startup/run.py --skip-cold         # keep the kernels: the int8 and warm rows only

The cache folder is a fresh temporary SERVELAB_CACHE_DIR, so the user's own cache is neither used nor touched."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_to_first_token(cache: Path, flags: list[str], timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "servelab.entrypoints.cli", "serve", "--port", str(port), *flags]
    log = cache.parent / f"serve-{port}.log"
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "SERVELAB_CACHE_DIR": str(cache)})
    try:
        while True:
            if proc.poll() is not None or time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        ready = time.perf_counter() - started
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    first_token = time.perf_counter() - started
                    break
        text = log.read_text(errors="replace")
        precision = next((line.strip() for line in text.splitlines() if line.strip().startswith("precision:")), "")
        return {"ready_s": round(ready, 2), "first_token_s": round(first_token, 2), "precision": precision,
                "int8_from_cache": "int8 weights from the cache" in text}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-cold", action="store_true", help="copy the kernels from ~/.cache/servelab/kernels "
                   "instead of compiling them (the second row then also converts the GGUF)")
    p.add_argument("--flags", default="", help="extra servelab serve flags, e.g. '--num-threads 2'")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=HERE / "result.json")
    args = p.parse_args()
    flags = args.flags.split()
    rows = []
    with tempfile.TemporaryDirectory(prefix="servelab-startup-") as tmp:
        cache = Path(tmp) / "cache"
        if args.skip_cold:
            shutil.copytree(Path.home() / ".cache" / "servelab" / "kernels", cache / "kernels")
        else:
            rows.append({"start": "empty cache folder", **start_to_first_token(cache, flags, args.timeout)})
        shutil.rmtree(cache / "quant", ignore_errors=True)
        second = ("kernels built, nothing else cached (GGUF conversion, int8 calibration)" if args.skip_cold
                  else "int8 entries removed (model converted, kernels built)")
        rows.append({"start": second,
                     **start_to_first_token(cache, flags, args.timeout)})
        rows.append({"start": "warm restart", **start_to_first_token(cache, flags, args.timeout)})
    result = {"command": "python benchmarks/startup/run.py " + " ".join(sys.argv[1:]), "cpu_count": os.cpu_count(),
              "load_average_before": os.getloadavg(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| start | ready s | first token s | int8 from cache |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['start']} | {r['ready_s']} | {r['first_token_s']} | {r['int8_from_cache']} |")
    print(rows[0]["precision"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
