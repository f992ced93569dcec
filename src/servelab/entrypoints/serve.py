"""The `servelab serve` command line: flags, then load the engine and hand over to entrypoints.api_server.
Imports nothing heavy until the command runs, so `servelab --help` stays fast."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.entrypoints.cache_dir import check_cache_dir
from servelab.gateway.config import DEFAULT_SERVED_MODEL_NAME, ROUTERS, ServerConfig
from servelab.parsers.reasoning import REASONING_PARSERS

if TYPE_CHECKING:
    from servelab.engine.core_client import EngineCoreClient
    from servelab.engine_args import EngineArgs
    from servelab.model.tokenizer import Tokenizer

logger = logging.getLogger("servelab.gateway")



# libgomp's spin before an idle OpenMP thread sleeps: about 100,000 spins a millisecond (its own estimate), so
# 10,000 is ~0.1 ms. See set_openmp_wait.
OPENMP_SPIN_COUNT = "10000"


def set_openmp_wait(engine_in_process: bool) -> None:
    """How idle OpenMP threads wait, set before torch loads libgomp (the engine cores inherit it); the user's
    own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. An engine core in its own process spins ~0.1 ms, which covers
    the Python between one step's parallel regions, and sleeps between steps, which leaves the cores to the
    API server and the clients (libgomp's default spins ~3 ms, its PASSIVE not at all). Served on this
    machine, alternating, 3 rounds (int8 weights and KV): the 64-request burst 502 -> 546 output tok/s
    (median), one stream at a time 30.2 -> 39.0 tok/s. An engine stepped by a thread of the API server
    (--engine-in-process) keeps PASSIVE: there spinning workers fought the event loop (one stream decoded at
    23.5 ms per token spinning, 17.5 ms without)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if engine_in_process:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT

def add_serve_parser(sub) -> None:
    from servelab.engine_args import EngineArgs

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
                           description="Serve a model with OpenAI's /v1/completions and /v1/chat/completions.")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="Hugging Face model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    EngineArgs.add_cli_args(serve)
    EngineArgs.add_process_cli_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any free port)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API accepts; the first is reported (default: the model's basename)")
    g.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (repeatable; default: $SERVELAB_API_KEY)")
    g.add_argument("--protect-metrics", action="store_true", help="require the API key on /metrics too")
    g.add_argument("--router", choices=ROUTERS, default="least-loaded",
                   help="which engine core takes a request with --data-parallel-size or --disaggregate: the least "
                        "loaded, or prefix (KV-cache-aware: where its prompt's leading blocks were sent, against "
                        "load)")
    g.add_argument("--max-num-queued-requests", type=int, default=256,
                   help="requests waiting for their first token before new ones get 429")
    g.add_argument("--max-queued-tokens", type=int, default=131072,
                   help="prompt tokens waiting to be prefilled before new requests get 429")
    g.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run before it is ended with an error (0 = no limit)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between snapshots on /v1/metrics/stream")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="enable CORS for these origins (e.g. https://app.example.com; '*' for any); off by default")
    limits = serve.add_argument_group("request limits (hostile or broken clients)")
    limits.add_argument("--max-n", type=int, default=16, help="most completions (n) per request")
    limits.add_argument("--max-logprobs", type=int, default=20, help="most logprobs / top_logprobs per token")
    limits.add_argument("--max-stop-strings", type=int, default=64, help="most stop strings per request")
    limits.add_argument("--max-stop-string-len", type=int, default=256, help="most characters in one stop string")
    limits.add_argument("--header-read-timeout", type=float, default=10.0,
                        help="seconds a client has to send a request's headers (slowloris) before the "
                             "connection is closed")
    limits.add_argument("--body-read-timeout", type=float, default=30.0,
                        help="seconds a client has to send the whole request body before it gets 408")
    limits.add_argument("--max-unsent-tokens", type=int, default=4096,
                        help="generated tokens a stream may hold unsent (a client that stopped reading) "
                             "before the request is aborted and its KV cache freed")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> out of chat output into reasoning_content")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=run_serve)


def served_model_names(model: str | None, names: list[str] | None) -> tuple[str, ...]:
    if names:
        return tuple(names)
    if model is None:
        return (DEFAULT_SERVED_MODEL_NAME,)
    return (Path(model.rstrip("/")).name or model,)


def server_config(args: argparse.Namespace, model: str | None) -> ServerConfig:
    keys = args.api_key or ([os.environ["SERVELAB_API_KEY"]] if os.environ.get("SERVELAB_API_KEY") else [])
    return ServerConfig(
        served_model_names=served_model_names(model, args.served_model_name), host=args.host, port=args.port,
        api_keys=tuple(keys), protect_metrics=args.protect_metrics,
        max_num_queued_requests=args.max_num_queued_requests, max_queued_tokens=args.max_queued_tokens,
        max_request_bytes=args.max_request_bytes, request_timeout=args.request_timeout or None,
        shutdown_grace=args.shutdown_grace, metrics_interval=args.metrics_interval,
        max_n=args.max_n, max_logprobs=args.max_logprobs, max_stop_strings=args.max_stop_strings,
        max_stop_string_len=args.max_stop_string_len, header_read_timeout=args.header_read_timeout,
        body_read_timeout=args.body_read_timeout, max_unsent_tokens=args.max_unsent_tokens,
        allowed_origins=tuple(args.allowed_origins or ()), reasoning_parser=args.reasoning_parser,
        router=args.router)


def _configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("servelab")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def run_serve(args: argparse.Namespace) -> int:
    from servelab.engine_args import EngineArgs

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    model = args.model_tag or args.model
    args.model = model
    config = server_config(args, model)  # flag errors before the (slow) model load
    check_cache_dir()  # a full disk or read-only cache: one clear error now, not a traceback mid-load
    _configure_logging(args.log_level)
    engine_args = EngineArgs.from_cli_args(args)
    set_openmp_wait(engine_args.engine_in_process)
    check_node_flags(engine_args)
    if engine_args.headless:
        from servelab.executor.headless import run_headless

        return run_headless(engine_args)
    if engine_args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {engine_args.data_parallel_size}")
    if engine_args.engine_in_process and engine_args.data_parallel_size > 1:
        raise ValueError("--engine-in-process runs one engine: it cannot be combined with --data-parallel-size > 1")
    if engine_args.disaggregate is not None:
        from servelab.config import parse_disaggregate

        parse_disaggregate(engine_args.disaggregate)
        if engine_args.engine_in_process or engine_args.data_parallel_size > 1 or engine_args.tensor_parallel_size > 1:
            raise ValueError("--disaggregate P:D runs P + D single-rank engine-core processes: it cannot be combined "
                             "with --engine-in-process, --data-parallel-size or --tensor-parallel-size")
    logger.info("loading %s", model or DEFAULT_SERVED_MODEL_NAME)
    cores, tokenizer, rendezvous = _start_engine_cores(engine_args, args.log_level)
    try:
        from servelab.engine.process_layout import process_layout
        from servelab.entrypoints.api_server import serve
        from servelab.lab.web.routes import LAYOUT_ROUTE, build_lab_router

        # The lab page and its API never touch the model: outside /v1, so no API key (like /health).
        lab = build_lab_router(live_engine={"metrics_stream": "/v1/metrics/stream",
                                            "needs_api_key": config.protect_metrics and bool(config.api_keys),
                                            "layout": LAYOUT_ROUTE},
                               layout=lambda: process_layout(cores).to_json())
        return serve(cores, tokenizer, config, model_path=model, log_level=args.log_level, routers=(lab,))
    finally:
        for core in cores:  # engine-core processes are never left behind, however serving ended
            core.close()
        del rendezvous


def check_node_flags(args: EngineArgs) -> None:
    """The multi-node combinations `servelab serve` refuses before loading anything (ParallelConfig checks
    the numbers themselves)."""
    args.parallel_config()
    if args.node_rank > 0 and not args.headless:
        raise ValueError(f"--node-rank {args.node_rank} runs only worker ranks: add --headless (node 0 runs the "
                         "API server and the engine core)")
    if args.headless and args.node_rank == 0:
        raise ValueError("--headless is for nodes with --node-rank > 0: node 0 runs the API server and the "
                         "engine core")
    if args.nnodes > 1 and args.data_parallel_size > 1:
        raise ValueError("--nnodes > 1 spreads one engine's tensor-parallel ranks; it cannot be combined with "
                         "--data-parallel-size > 1")


def _start_engine_cores(engine_args: EngineArgs, log_level: str) -> tuple[list[EngineCoreClient], Tokenizer, object]:
    """The engine cores (processes, or one in this process), the tokenizer the API server uses, and what
    must live as long as the cores (a disaggregated deployment's rendezvous store; else None)."""
    if engine_args.engine_in_process:
        from servelab.engine.core_client import InprocClient
        from servelab.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args)
        return [InprocClient(engine)], engine.tokenizer, None
    from servelab.engine.mp_client import launch_engine_cores
    from servelab.engine.core_proc.core_process import EngineFactory, engine_from_args
    from servelab.model.loader import resolve_model_path
    from servelab.model.tokenizer import Tokenizer

    dp = engine_args.data_parallel_size
    num_engines = dp
    if engine_args.disaggregate is not None:
        from servelab.config import parse_disaggregate

        num_engines = sum(parse_disaggregate(engine_args.disaggregate))
    if num_engines > 1 and engine_args.num_threads is None:
        # replicas and instances share the machine's cores instead of each taking all of them
        engine_args = dataclasses.replace(engine_args, num_threads=max(1, (os.cpu_count() or 1) // num_engines))
    folder = resolve_model_path(engine_args.model)  # converts a GGUF once, here, before the cores read it
    tokenizer = Tokenizer.from_pretrained(folder)
    if engine_args.disaggregate is not None:
        from servelab.engine.core_proc.disagg_launcher import launch_disaggregated

        def factory_for(kv_config):
            return EngineFactory(engine_from_args, (dataclasses.replace(engine_args, kv_transfer_config=kv_config),))

        deployment = launch_disaggregated(factory_for, *parse_disaggregate(engine_args.disaggregate),
                                          log_level=log_level)
        logger.info("engine cores ready: pids %s (prefill: %s)", ", ".join(str(c.pid) for c in deployment.cores),
                    ", ".join(str(c.pid) for c in deployment.cores if c.info.kv_role == "kv_producer"))
        return deployment.cores, tokenizer, deployment.store
    cores = launch_engine_cores(EngineFactory(engine_from_args, (engine_args,)), dp, log_level)
    logger.info("engine cores ready: pids %s", ", ".join(str(core.pid) for core in cores))
    return cores, tokenizer, None
