"""servelab beside llama.cpp's llama-server and Hugging Face transformers on the default model, each peer in
its best configuration, same prompts (`servelab bench peers`); writes peers-smollm2/ here.

    python benchmarks/peers/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    "bench peers --only servelab,llama.cpp,hf --quantization int8,int8+kv-int8,gguf --skip-build --name "
    "smollm2",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
