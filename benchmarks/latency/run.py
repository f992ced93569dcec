"""Single-request bf16 decode of the default model (`servelab bench latency`); writes latency-bf16-b1.{json,md} here.

    python benchmarks/latency/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    "bench latency --dtype bfloat16 --input-len 32 --output-len 128 --num-iters 3 --name latency-bf16-b1",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
