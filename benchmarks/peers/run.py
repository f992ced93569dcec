"""servelab beside llama.cpp's llama-server and Hugging Face transformers on the default model, each peer in
its best configuration, same prompts (`servelab bench peers`); writes peers-smollm2/ here.

    python benchmarks/peers/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    # servelab with no flags (what `make run` serves) and with float weights (--quantization none); llama.cpp is
    # built from the llama-cpp-python sdist on first use and cached
    "bench peers --only servelab,llama.cpp,hf --quantization default,none --name smollm2",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
