"""`servelab bench perplexity`: the quality gate for --quantization and --kv-cache-dtype. Perplexity of the default model
(or --model) on a fixed public-domain text shipped with servelab, per precision, beside llama.cpp's
llama-perplexity on the same GGUF when the peers build is there.

The text (bench/data/declaration_of_independence.txt) is the United States Declaration of
Independence (1776) followed by Lincoln's Gettysburg Address (1863, Bliss copy): both are in the
public domain. Scoring follows llama-perplexity: the tokens are cut into chunks of --ctx; each chunk is
one prefill and only the predictions of its second half are scored (each with at least ctx/2 tokens
of context), so the two programs average the same negative log-likelihoods."""
from __future__ import annotations

import argparse
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

from servelab.bench.results import DEFAULT_DIR

TEXT = Path(__file__).parent / "data" / "declaration_of_independence.txt"
# name -> (dtype, quantization, kv_cache_dtype)
PRECISIONS = {"float32": ("float32", None, "auto"), "bfloat16": ("bfloat16", None, "auto"),
              "gguf": ("bfloat16", "gguf", "auto"), "int8": ("bfloat16", "int8", "auto"),
              "bfloat16+kv-int8": ("bfloat16", None, "int8"), "int8+kv-int8": ("bfloat16", "int8", "int8"),
              "default": ("auto", "auto", "auto")}  # no flags: what --quantization auto picks for the model
# Each quantized precision must stay this close to bf16's perplexity.
MAX_RELATIVE_GAP = 0.03


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity per precision on a shipped public-domain text, "
                                          "beside llama.cpp's llama-perplexity")
    p.add_argument("--model", default=None, help=".gguf file (default: SmolLM2-135M-Instruct's Q4_1 GGUF)")
    p.add_argument("--precisions", default=",".join(PRECISIONS),
                   help=f"comma-separated, from {', '.join(PRECISIONS)}")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--llama-cpp-dir", type=Path, default=None,
                   help="folder with llama-perplexity (default: servelab bench peers' build in the cache, if any)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--step-tokens", type=int, default=None,
                   help="feed each chunk this many tokens per forward (default: the whole chunk in one); 4 or "
                        "fewer scores the paths decode steps take (GGUF matrices multiply 8-bit-rounded inputs)")
    p.add_argument("--name", default="perplexity")
    p.add_argument("--result-dir", type=Path, default=DEFAULT_DIR, help="folder for the result files")
    p.set_defaults(func=run)


def chunk_nll(logits, token_ids: list[int]) -> tuple[float, int]:
    """Sum of -log p(next token) over the chunk's second half, and how many were scored."""
    import torch

    first = len(token_ids) // 2
    logprobs = torch.log_softmax(logits[first:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[first + 1:])
    return float(-logprobs.gather(1, targets[:, None]).sum()), len(targets)


def chunks(token_ids: list[int], ctx: int) -> list[list[int]]:
    if len(token_ids) < 2 * ctx:
        raise ValueError(f"the text has {len(token_ids)} tokens; perplexity with --ctx {ctx} needs {2 * ctx}")
    return [token_ids[i * ctx:(i + 1) * ctx] for i in range(len(token_ids) // ctx)]


def servelab_perplexity(model: str | None, precision: str, text: str, ctx: int, num_threads: int | None,
                        step_tokens: int | None = None) -> dict:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine_args import EngineArgs

    dtype, quantization, kv_cache_dtype = PRECISIONS[precision]
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype=dtype, quantization=quantization,
                                                   kv_cache_dtype=kv_cache_dtype,
                                                   num_threads=num_threads, max_model_len=ctx,
                                                   num_kv_blocks=-(-ctx // 16)))
    return {"precision": precision, "dtype": dtype, "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
            **engine_perplexity(engine, text, step_tokens)}


def engine_perplexity(engine, text: str, step_tokens: int | None = None, ctx: int | None = None) -> dict:
    """Perplexity of an idle engine on text, in chunks of ctx tokens (default: its max_model_len)."""
    ctx = ctx or engine.max_model_len
    # The tokenizer adds BOS where the model asks for it, as llama-perplexity's tokenization does.
    token_ids = engine.tokenizer.encode(text)
    total, count = 0.0, 0
    parts = chunks(token_ids, ctx)
    for part in parts:
        nll, n = chunk_nll(engine.executor.prompt_logits(part, step_tokens), part)
        total, count = total + nll, count + n
    return {"perplexity": math.exp(total / count), "num_scored_tokens": count, "num_chunks": len(parts),
            "weight_bytes": engine.executor.weight_bytes, "step_tokens": step_tokens or ctx}


def llama_cpp_perplexity(binary: Path, gguf: Path, text_path: Path, ctx: int, num_threads: int) -> dict:
    command = [str(binary), "-m", str(gguf), "-f", str(text_path), "-c", str(ctx), "-t", str(num_threads),
               "-b", str(ctx)]
    print("+ " + shlex.join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    output = result.stdout + result.stderr
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    if result.returncode or match is None:
        raise RuntimeError(f"llama-perplexity failed ({result.returncode}):\n{output[-3000:]}")
    return {"precision": f"llama.cpp ({gguf.name})", "perplexity": float(match.group(1)),
            "weight_bytes": gguf.stat().st_size, "command": command}


def _llama_perplexity_binary(directory: Path | None) -> Path | None:
    from servelab.bench.peers.llama_cpp_build import cache_dir, existing_tools

    if directory is not None:
        return existing_tools(directory).path("llama-perplexity")
    binary = cache_dir() / "build" / "bin" / "llama-perplexity"
    return binary if binary.is_file() else None


def run(args: argparse.Namespace) -> int:
    import os

    from servelab.bench.results import markdown_table, write_results
    from servelab.model.gguf_weights import gguf_file

    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise SystemExit(f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
    if args.step_tokens is not None and not 1 <= args.step_tokens <= args.ctx:
        raise SystemExit(f"--step-tokens must be between 1 and --ctx ({args.ctx}), got {args.step_tokens}")
    text = args.text.read_text(encoding="utf-8")
    rows = [servelab_perplexity(args.model, p, text, args.ctx, args.num_threads, args.step_tokens)
            for p in precisions]
    binary = _llama_perplexity_binary(args.llama_cpp_dir)
    if binary is not None:
        rows.append(llama_cpp_perplexity(binary, gguf_file(args.model), args.text, args.ctx,
                                         args.num_threads or os.cpu_count() or 1))
    else:
        print("llama-perplexity not found (run `servelab bench peers` once to build it): servelab rows only")
    bf16 = next((r["perplexity"] for r in rows if r["precision"] == "bfloat16"), None)
    for r in rows:
        r["vs_bf16"] = None if bf16 is None else r["perplexity"] / bf16 - 1
    failed = [r["precision"] for r in rows
              if (r.get("quantization") or r.get("kv_cache_dtype", "auto") != "auto") and r["vs_bf16"] is not None
              and r["vs_bf16"] > MAX_RELATIVE_GAP]
    table = [{"precision": r["precision"], "perplexity": r["perplexity"], "weight MiB": r["weight_bytes"] / 2**20,
              "vs bf16": "" if r["vs_bf16"] is None else f"{100 * r['vs_bf16']:+.2f}%"} for r in rows]
    payload = {"text": str(args.text.name), "ctx": args.ctx, "step_tokens": args.step_tokens or args.ctx,
               "max_relative_gap": MAX_RELATIVE_GAP, "rows": rows,
               "within_gap": not failed, "command": "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    json_path, _ = write_results(args.name, payload, table, out_dir=args.result_dir)
    print(markdown_table(table))
    print(f"results: {json_path}")
    if failed:
        print(f"over {100 * MAX_RELATIVE_GAP:g}% above bf16's perplexity: {', '.join(failed)}")
        return 1
    return 0
