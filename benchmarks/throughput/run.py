"""Offline bf16 throughput of the default model, continuous against static batching and the Hugging Face
baseline (`servelab bench throughput`); writes throughput-bf16-256.{json,md} here.

    python benchmarks/throughput/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    "bench throughput --dtype bfloat16 --num-prompts 256 --schedules continuous,static --max-num-seqs 32 "
    "--baseline hf --baseline-num-prompts 32 --name throughput-bf16-256",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
