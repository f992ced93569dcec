"""`servelab serve` over the stub engine, as a real process: the real gateway, uvicorn, signals and drain,
with a real LLMEngine whose executor needs no model (servelab/testing/stub_engine.py). The soak, the fuzzing
run and the hostile-client tests drive it over 127.0.0.1 (StubServerProcess starts one on a free port).

    python -m servelab.testing.stub_server [--stub-* options] [any `servelab serve` server flag]

--stub-fail-word WORD: every step that computes WORD raises (only that step's requests fail);
--stub-fatal-word WORD: the first step that computes WORD kills the engine core (engine_dead)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from servelab.engine.core_client import InprocClient
from servelab.entrypoints.serve import _configure_logging, add_serve_parser, server_config
from servelab.entrypoints.api_server import serve
from servelab.testing.server import ServerProcess, free_port
from servelab.testing.stub_engine import VOCAB, make_engine


class StubServerProcess(ServerProcess):
    """A ServerProcess (readiness, log, signals, stop) running the stub server instead of `servelab serve`."""

    def __init__(self, flags: tuple[str, ...], log_path: Path) -> None:  # not the parent's: another command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [sys.executable, "-m", "servelab.testing.stub_server", "--host", "127.0.0.1", "--port",
                   str(self.port), *flags]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)


def main(argv: list[str]) -> int:
    stub = argparse.ArgumentParser(add_help=False)
    stub.add_argument("--stub-num-blocks", type=int, default=1024)
    stub.add_argument("--stub-block-size", type=int, default=16)
    stub.add_argument("--stub-max-model-len", type=int, default=2048)
    stub.add_argument("--stub-max-num-seqs", type=int, default=64)
    stub.add_argument("--stub-step-delay", type=float, default=0.0)
    stub.add_argument("--stub-fail-word", default=None)
    stub.add_argument("--stub-fatal-word", default=None)
    options, rest = stub.parse_known_args(argv)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *rest])
    config = server_config(args, None)
    _configure_logging(args.log_level)
    engine = make_engine(num_blocks=options.stub_num_blocks, block_size=options.stub_block_size,
                         max_model_len=options.stub_max_model_len, max_num_seqs=options.stub_max_num_seqs,
                         step_delay=options.stub_step_delay,
                         fail_every_token_id=VOCAB.index(options.stub_fail_word) if options.stub_fail_word else None,
                         fatal_on_token_id=VOCAB.index(options.stub_fatal_word) if options.stub_fatal_word else None,
                         keep_plans=False)
    return serve([InprocClient(engine)], engine.tokenizer, config, log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
