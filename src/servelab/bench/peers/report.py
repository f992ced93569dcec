"""The table, machine summary and plot of `servelab bench peers` (from its result dict, so a saved JSON
can be written again)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

# The ISA features that decide CPU inference speed, in the order they are printed.
KEY_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8")
PEER_COLORS = {"servelab": "tab:blue", "llama.cpp": "tab:orange", "hf": "tab:green"}


def parse_lscpu(text: str) -> dict:
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    return {"model_name": fields.get("Model name", "unknown"), "num_cpus": int(fields.get("CPU(s)", "0") or 0),
            "key_flags": [f for f in KEY_FLAGS if f in flags], "num_flags": len(flags)}


def cpu_summary() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    if "Model name" not in text:  # no lscpu: /proc/cpuinfo has the same fields under other names
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
        first = cpuinfo.split("\n\n")[0]
        text = re.sub(r"^model name", "Model name", first, flags=re.MULTILINE).replace("\nflags", "\nFlags")
        text += f"\nCPU(s): {cpuinfo.count('processor')}"
    return parse_lscpu(text)


def _fmt_ms(run: dict, key: str):
    return run[key] if key in run else "-"


def table_rows(runs: list[dict]) -> list[dict]:
    return [{"workload": r["workload"], "engine": r["engine"], "config": r["config"],
             "output tok/s": r["output_throughput"], "TTFT p50 ms": _fmt_ms(r, "median_ttft_ms"),
             "TTFT p99 ms": _fmt_ms(r, "p99_ttft_ms"), "TPOT p50 ms": _fmt_ms(r, "median_tpot_ms"),
             "ok/failed": f"{r['completed']}/{r['failed']}" if "completed" in r else "-",
             "duration s": r.get("duration", "-"),
             "% of BW roofline": f"{r['roofline_share']:.0%}" if "roofline_share" in r else "-"} for r in runs]


def roofline_rows(roofline: dict) -> list[dict]:
    by_kind: dict[str, dict] = {}
    for point in roofline["gemm"]:
        by_kind.setdefault(point["kind"], {"GEMM": point["kind"]})[f"GFLOP/s M={point['m']}"] = point["gflops"]
    return list(by_kind.values())


def machine_markdown(result: dict) -> str:
    from servelab.bench.results import markdown_table

    cpu, roofline = result["cpu"], result["roofline"]
    return (f"## Machine\n\n{cpu['model_name']}, {cpu['num_cpus']} CPUs; flags: {' '.join(cpu['key_flags'])}\n\n"
            f"Read bandwidth: {roofline['read_bandwidth_gbs']:.1f} GB/s (a written "
            f"{roofline['bandwidth_buffer_bytes'] / 2**30:g} GiB buffer, summed). GEMMs on the model's linear "
            f"shapes, one forward's mix, {roofline['torch_threads']} torch threads:\n\n"
            f"{markdown_table(roofline_rows(roofline))}\n")


def write_peers(name: str, result: dict, out_dir: Path) -> tuple[Path, Path]:
    """<name>.json, <name>.md (the table, then the machine and its roofline) and peers.png."""
    from servelab.bench.results import write_results

    json_path, md_path = write_results(name, result, table_rows(result["runs"]), out_dir=out_dir)
    md_path.write_text(md_path.read_text() + "\n" + machine_markdown(result))
    plot_peers(result, out_dir / "peers.png")
    return json_path, md_path


def _bars(ax, runs: list[dict], key: str, ylabel: str, title: str) -> None:
    x = np.arange(len(runs))
    ax.bar(x, [r[key] for r in runs], color=[PEER_COLORS.get(r["peer"], "tab:gray") for r in runs])
    ax.set_xticks(x, [f"{r['engine']}\n{r['config']}" for r in runs], rotation=20, ha="right", fontsize=6)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)


def plot_peers(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from servelab.bench.report import request_ttfts

    fig, axes = plt.subplots(2, 3, figsize=(15.0, 8.5))
    runs = result["runs"]
    by = lambda kind: [r for r in runs if r["kind"] == kind]  # noqa: E731
    _bars(axes[0, 0], by("burst"), "output_throughput", "output tokens/s", "burst: output tokens/s")
    poisson = by("poisson")
    x = np.arange(len(poisson))
    axes[0, 1].bar(x - 0.2, [r["median_ttft_ms"] for r in poisson], 0.4, label="p50")
    axes[0, 1].bar(x + 0.2, [r["p99_ttft_ms"] for r in poisson], 0.4, label="p99")
    axes[0, 1].set_xticks(x, [f"{r['engine']}\n{r['config']}" for r in poisson], rotation=20, ha="right", fontsize=6)
    axes[0, 1].set_ylabel("TTFT ms")
    axes[0, 1].set_title("Poisson arrivals: TTFT", fontsize=9)
    axes[0, 1].legend(fontsize=8)
    axes[0, 1].grid(True, axis="y", alpha=0.3)
    for r in poisson:
        ms = np.sort(np.asarray(request_ttfts(r))) * 1000.0
        if ms.size:
            axes[0, 2].step(ms, np.arange(1, ms.size + 1) / ms.size, where="post",
                            label=f"{r['engine']} {r['config']}")
    axes[0, 2].set_xlabel("TTFT ms")
    axes[0, 2].set_ylabel("share of requests")
    axes[0, 2].set_title("Poisson arrivals: TTFT CDF", fontsize=9)
    axes[0, 2].legend(fontsize=6)
    axes[0, 2].grid(True, alpha=0.3)
    _bars(axes[1, 0], by("offline"), "output_throughput", "output tokens/s", "offline: output tokens/s")
    _bars(axes[1, 1], by("decode"), "output_throughput", "tokens/s", "single-stream decode (batch 1)")
    for kind in dict.fromkeys(p["kind"] for p in result["roofline"]["gemm"]):
        points = [p for p in result["roofline"]["gemm"] if p["kind"] == kind]
        axes[1, 2].plot([p["m"] for p in points], [p["gflops"] for p in points], marker="o", label=kind)
    axes[1, 2].set_xscale("log", base=2)
    axes[1, 2].set_xlabel("M (tokens in the batch)")
    axes[1, 2].set_ylabel("GFLOP/s")
    axes[1, 2].set_title(f"roofline: GEMMs on the model's shapes; read {result['roofline']['read_bandwidth_gbs']:.1f}"
                         " GB/s", fontsize=9)
    axes[1, 2].legend(fontsize=8)
    axes[1, 2].grid(True, alpha=0.3)
    cpu = result["cpu"]
    fig.suptitle(f"{result.get('model', '')} on {cpu['model_name']} ({cpu['num_cpus']} CPUs; "
                 f"{' '.join(cpu['key_flags'])})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
