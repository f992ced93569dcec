"""The products of a decode step's few rows, each against what it replaced, side by side (rounds alternate
between the two on the same operands; medians compared). Written to benchmarks/few_row_products/few_row_products.json.

- GGUF, one row: fp32 inputs against inputs rounded to 8 bits (`linear_gguf(..., int8_inputs=True)`, what
  every dtype but float32 runs), on a matrix of ~70 M weights, far larger than the caches;
- W8A8 (--quantization int8), 1-16 rows: `int8_matmul_rows` against torch._int_mm padded to its 17 rows,
  over the default model's 30 layers of q|k|v, o, gate|up and down (106 M weights).

    .venv/bin/python benchmarks/few_row_products/run.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12}


def random_blocks(gguf_type: int, rows: int, cols: int) -> torch.Tensor:
    """Random valid blocks: random bytes with small positive fp16 scales (as tests/kernels/test_linear_quant.py)."""
    from servelab.model.quant.quantization import GGUF_BLOCKS

    values, nbytes = GGUF_BLOCKS[gguf_type]
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (rows, cols // values, nbytes), dtype=torch.uint8, generator=g)
    halves = 1 if gguf_type in (2, 8) else 2
    scales = (torch.rand(rows, cols // values, halves, generator=g) * 0.02 + 0.001).half()
    blocks[..., :2 * halves] = scales.view(torch.uint8).view(rows, cols // values, 2 * halves)
    return blocks.reshape(rows, -1)


# The default model's (K, N) per layer: q|k|v, o, gate|up, down.
SMOLLM2_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def int8_rows(ops, rounds: int, num_layers: int = 30) -> list[dict]:
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(2)
    layers = [[torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g) for k, n in SMOLLM2_SHAPES]
              for _ in range(num_layers)]
    out = []
    for m in (1, 2, 4, 8, 16):
        xs = [torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g) for k, _ in SMOLLM2_SHAPES]
        runs = {"int8_matmul_rows": lambda: [ops.int8_matmul_rows(x, w) for ws in layers for w, x in zip(ws, xs)],
                "int_mm_padded": lambda: [torch._int_mm(F.pad(x, (0, 0, 0, 17 - m)), w.t())
                                          for ws in layers for w, x in zip(ws, xs)]}
        seconds = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                run()
                start = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - start)
        row = {"rows": m, **{f"{name}_ms": 1e3 * statistics.median(s) for name, s in seconds.items()},
               **{f"{name}_spread_ms": [1e3 * min(s), 1e3 * max(s)] for name, s in seconds.items()}}
        row["speedup"] = row["int_mm_padded_ms"] / row["int8_matmul_rows_ms"]
        out.append(row)
        print(f"W8A8 {m} rows, 30 layers: int8_matmul_rows {row['int8_matmul_rows_ms']:.1f} ms, _int_mm padded "
              f"{row['int_mm_padded_ms']:.1f} ms ({row['speedup']:.2f}x)", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rows", type=int, default=120_000)
    p.add_argument("--cols", type=int, default=576)
    p.add_argument("--calls", type=int, default=20, help="products timed per round")
    p.add_argument("--out", type=Path, default=HERE / "results" / "few_row_products.json")
    args = p.parse_args()
    from servelab.kernels import cpu_ops

    ops = cpu_ops()
    if ops is None:
        print("servelab's CPU kernels are not available here (AVX2 + FMA + F16C and a C++ compiler)", file=sys.stderr)
        return 1
    x = torch.randn(1, args.cols, generator=torch.Generator().manual_seed(1))
    rows = []
    for name, gguf_type in TYPES.items():
        cols = args.cols - args.cols % 256 if gguf_type == 12 else args.cols
        blocks = random_blocks(gguf_type, args.rows, cols)
        xs = x[:, :cols].contiguous()
        seconds = {False: [], True: []}
        for _ in range(args.rounds):
            for int8_inputs in (False, True):
                ops.linear_gguf(xs, blocks, gguf_type, int8_inputs)
                start = time.perf_counter()
                for _ in range(args.calls):
                    ops.linear_gguf(xs, blocks, gguf_type, int8_inputs)
                seconds[int8_inputs].append((time.perf_counter() - start) / args.calls)
        row = {"type": name, "bytes": blocks.numel()}
        for int8_inputs, label in ((False, "fp32_inputs"), (True, "int8_inputs")):
            gbs = [blocks.numel() / s / 1e9 for s in seconds[int8_inputs]]
            row[label] = {"median_ms": 1e3 * statistics.median(seconds[int8_inputs]),
                          "median_gbs": statistics.median(gbs), "min_gbs": min(gbs), "max_gbs": max(gbs)}
        row["speedup"] = row["fp32_inputs"]["median_ms"] / row["int8_inputs"]["median_ms"]
        rows.append(row)
        print(f"{name}: fp32 inputs {row['fp32_inputs']['median_gbs']:.1f} GB/s, 8-bit inputs "
              f"{row['int8_inputs']['median_gbs']:.1f} GB/s ({row['speedup']:.2f}x)", flush=True)
    w8a8 = int8_rows(ops, args.rounds)
    payload = {"command": "python benchmarks/few_row_products/run.py " + " ".join(sys.argv[1:]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
               "num_threads": torch.get_num_threads(), "rows": args.rows, "rounds": args.rounds, "gguf_one_row": rows,
               "w8a8_few_rows": w8a8}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
