"""servelab command line: serve | generate | bench | lab."""
from __future__ import annotations

import argparse
import sys


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    from servelab.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="servelab", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from servelab.entrypoints.serve import add_serve_parser
    add_serve_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks (results under ./bench-results/ unless --result-dir)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from servelab.bench import perplexity
    from servelab.bench.offline import latency, throughput
    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    perplexity.add_parser(bench_sub)
    from servelab.bench import serve as bench_serve, stages, sweep
    bench_serve.add_parser(bench_sub)
    sweep.add_parser(bench_sub)
    stages.add_parser(bench_sub)
    from servelab.bench.peers import command as peers
    peers.add_parser(bench_sub)

    from servelab.lab.cli import add_lab_parser
    from servelab.lab.web.server import add_web_parser
    add_web_parser(add_lab_parser(sub))
    return parser


class _Version(argparse.Action):
    """--version: print version_text() (argparse's own version action rewraps it) and exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version and whether the compiled lab modules are in use (SERVELAB_COMPILED)"):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """`servelab --version`: the version and whether the compiled simulator modules are in use."""
    from importlib.metadata import PackageNotFoundError, version

    from servelab import compiled

    try:
        number = version("servelab")
    except PackageNotFoundError:
        number = "unknown"
    return f"servelab {number}\n{compiled.describe()}"


def _cmd_generate(args: argparse.Namespace) -> int:
    from servelab.engine_args import EngineArgs
    from servelab.engine.llm_engine import LLMEngine
    from servelab.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    prompt = args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}
    engine.add_request(engine.input_processor.process_inputs("cli", prompt, params))
    shown = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)
    sys.stdout.write("\n")
    return 0


def flag_message(err: ValueError) -> str:
    """A FieldError names its fields as this command line's flags."""
    from servelab.errors import FieldError
    from servelab.lab.cli import flag_name

    return err.render(flag_name) if isinstance(err, FieldError) else str(err)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as exc:
        print(f"servelab: error: {flag_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
