"""Write benchmark results as JSON + a markdown table under benchmarks/results/."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

DEFAULT_DIR = Path("benchmarks/results")


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
