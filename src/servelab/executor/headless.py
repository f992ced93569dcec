"""A headless node (`servelab serve --headless --node-rank N`, as in vLLM): this machine's tensor-parallel
ranks and nothing else. They join node 0's rendezvous store at --master-addr:--master-port, and from then
on node 0's rank 0 relays every step to them over torch.distributed; no API server, engine core or
tokenizer runs here. The node exits when its ranks do: 0 when node 0 shut them down, 1 when one failed."""
from __future__ import annotations

import dataclasses
import logging
import signal
from multiprocessing.connection import wait

from servelab.config import EngineConfig
from servelab.distributed.worker_protocol import WorkerFailed
from servelab.engine_args import EngineArgs
from servelab.executor.multiproc_executor import num_cores, spawn_workers

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 300.0


def headless_config(args: EngineArgs) -> tuple[str, EngineConfig]:
    """The model folder and the config every rank of this node builds its shard from; the flags must be
    node 0's (same model, dtype, KV pool), with this node's --node-rank."""
    from servelab.model.quant.auto_quantization import resolve_quantization
    from servelab.model.loader import load_model_config, resolve_dtype, resolve_model_path

    choice = resolve_quantization(args)  # node 0 resolves the same flags to the same mode
    args = dataclasses.replace(args, quantization=choice.quantization, kv_cache_dtype=choice.kv_cache_dtype)
    folder = resolve_model_path(args.model)
    model_config = load_model_config(folder)
    config = EngineConfig(model=model_config, cache=args.cache_config(),
                          scheduler=args.scheduler_config(model_config.max_position_embeddings),
                          parallel=args.parallel_config(), dtype=str(resolve_dtype(args.dtype)).removeprefix("torch."),
                          quantization=choice.quantization)
    if config.parallel.node_rank == 0:
        raise ValueError("--headless is for nodes with --node-rank > 0: node 0 runs the engine core")
    if config.parallel.master_port is None:
        raise ValueError("--headless needs --master-port: the port of node 0's rendezvous store")
    return folder, config


def run_headless(args: EngineArgs) -> int:
    folder, config = headless_config(args)
    parallel = config.parallel
    threads = args.num_threads or max(1, num_cores() // parallel.ranks_per_node)
    workers = spawn_workers(folder, config, parallel.master_addr, parallel.master_port, threads,
                            COLLECTIVE_TIMEOUT_S)
    ranks = list(parallel.local_ranks)
    logger.info("headless node %d of %d: tensor-parallel ranks %s (pids %s) joining %s:%d", parallel.node_rank,
                parallel.nnodes, ", ".join(map(str, ranks)), ", ".join(str(p.pid) for p in workers.processes),
                parallel.master_addr, parallel.master_port)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return _wait_for_ranks(workers)
    except KeyboardInterrupt:
        logger.info("headless node %d stopping its ranks", parallel.node_rank)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        workers.stop(graceful=False)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _wait_for_ranks(workers) -> int:
    """Log what the ranks report until every one has exited; 0 when all exited cleanly."""
    pending = {p.sentinel: p for p in workers.processes}
    conns = list(workers.conns)
    while pending:
        for ready in wait(list(pending) + conns):
            if ready in pending:
                pending.pop(ready).join()
            else:
                try:
                    message = ready.recv()
                except (EOFError, OSError):
                    conns.remove(ready)
                    continue
                if isinstance(message, WorkerFailed):
                    logger.error("tensor-parallel rank %d failed: %s\n%s", message.rank, message.error,
                                 message.traceback)
    codes = [p.exitcode for p in workers.processes]
    logger.info("headless node ranks exited with codes %s", codes)
    return 0 if all(code == 0 for code in codes) else 1
