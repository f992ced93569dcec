"""Write benchmark results as JSON + a markdown table, by default under ./bench-results/ (a benchmark topic of the
repository passes its own folder, benchmarks/<topic>/, as --result-dir)."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

DEFAULT_DIR = Path("bench-results")


def machine_info() -> dict:
    import os
    import torch
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def write_results(name: str, payload: dict, rows: list[dict], out_dir: Path = DEFAULT_DIR) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine_info(), **payload}
    json_path = out_dir / f"{name}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)  # a name may hold a folder: "quant/perplexity-smollm2"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path = out_dir / f"{name}.md"
    md_path.write_text(f"# {name}\n\n{markdown_table(rows)}\n\nCommand: `{payload.get('command', '')}`\n")
    return json_path, md_path


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:,.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def run_topic_commands(commands: list[str], result_dir: Path, extra: list[str]) -> None:
    """A benchmark topic's run.py: each `servelab ...` command (a string without the `servelab`), in a fresh
    process, with --result-dir result_dir and the extra flags given to run.py."""
    import shlex
    import subprocess
    import sys

    for command in commands:
        subprocess.run([sys.executable, "-m", "servelab.entrypoints.cli", *shlex.split(command),
                        "--result-dir", str(result_dir), *extra], check=True)
