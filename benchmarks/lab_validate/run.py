"""The lab's predictions against real runs of the same stages on this machine (`servelab lab validate`, after
`servelab lab profile`); writes lab-validate-stages123/, lab-validate-5stages/ and lab-validate-default-mode/ here.

    python benchmarks/lab_validate/run.py [extra flags for every command]
"""
import sys
from pathlib import Path

from servelab.bench.results import run_topic_commands

HERE = Path(__file__).parent
COMMANDS = [
    "lab validate --stages serial,static,continuous --repeats 3 --name lab-validate-stages123",
    "lab validate --stages serial,static,continuous,tp,disaggregated --repeats 1 --num-prompts 32 --name "
    "lab-validate-5stages",
    # the default mode (int8 weights + int8 KV for the default model) after `servelab lab profile --quick`
    "lab validate --stages serial,continuous --repeats 2 --num-prompts 32 --input-len 128 --output-len 64 --name "
    "lab-validate-default-mode",
]

if __name__ == "__main__":
    run_topic_commands(COMMANDS, HERE, sys.argv[1:])
