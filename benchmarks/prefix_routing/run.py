"""Stage 6 measured here and simulated: two engine-core replicas (`servelab serve -dp 2`) behind the least-loaded
router and behind `--router prefix`, on a shared-prefix workload, against the lab's `local-cpu` simulation of the
same two replicas (`servelab lab validate --stages dp,prefix`). Writes result.json and result.md beside this file.

    python benchmarks/prefix_routing/run.py            # profiles this machine first when it has no profile
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
WORKLOAD = ["--dataset", "prefix-shared", "--num-prefixes", "16", "--prefix-len", "384", "--input-len", "32",
            "--output-len", "16", "--num-prompts", "96", "--request-rate", "3", "--seed", "0"]


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelab.entrypoints.cli", *args], check=False, text=True, **kwargs)


def main() -> int:
    from servelab.lab.catalog.cpu_profile import load_cpu_profile

    try:
        load_cpu_profile()
    except ValueError:
        cli("lab", "profile", "--quick", check=True)
    with tempfile.TemporaryDirectory() as results:
        out = cli("lab", "validate", "--stages", "dp,prefix", "--repeats", "1", "--no-refresh-profile",
                  "--max-num-seqs", "16", "--json", "--result-dir", results, *WORKLOAD, stdout=subprocess.PIPE)
    (HERE / "result.json").write_text(out.stdout)
    rows = ["| stage | metric | real | simulated | error |", "| --- | --- | --- | --- | --- |"]
    for c in json.loads(out.stdout)["stages"]:
        for key, real in c["real"].items():
            sim, err = c["simulated"][key], c["error"][key]
            if real is None and sim is None:
                continue
            rows.append(f"| {c['stage']} | {key} | {real:.4g} | {sim:.4g} | "
                        + ("-" if err is None else f"{err:+.1%}") + " |")
    (HERE / "result.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
