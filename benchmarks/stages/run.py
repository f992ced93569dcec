"""The five evolution stages served one after another on the default model with the same seeded workload
(`servelab bench stages`); writes stages-smollm2/ here (the `-tp 3` stage alone in stages-smollm2-tp3/).

    python benchmarks/stages/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    "bench stages --num-prompts 128 --input-len 64 --output-len 64 --range-ratio 0.5 --request-rate 1.2 "
    "--max-num-seqs 32 --seed 0 --name stages-smollm2",
    "bench stages --stages tp --num-prompts 128 --input-len 64 --output-len 64 --range-ratio 0.5 "
    "--request-rate 1.2 --max-num-seqs 32 --seed 0 --name stages-smollm2-tp3",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
