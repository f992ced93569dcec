"""The whole reference set: every source document's file under data/reference/ (its header and its points),
the sources left out with the reason (data/reference/rejected.json), and the set's coverage.

    python -m servelab.lab.catalog.reference_files          # counts by precision, engine, GPU, context, P:D, batch
    python -m servelab.lab.catalog.reference_files --json
    python -m servelab.lab.catalog.reference_files --write-readme   # data/reference/README.md from the headers

Points whose GPU, model or dtype the catalog lacks still load (reference.lab_gaps names what is missing), so
the set can cite measurements the lab cannot simulate yet; load_reference_points() keeps to the fitted sources."""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from functools import cache

from servelab.executor.efficiency import ENGINES
from servelab.lab.catalog.calibration import DEFAULT_CALIBRATION, load_calibration
from servelab.lab.catalog.reference import REFERENCE_DIR, ReferenceDataError, ReferencePoint, check_unique_ids, \
    lab_gaps, parse_point

REJECTED_FILE = REFERENCE_DIR / "rejected.json"
README_FILE = REFERENCE_DIR / "README.md"
SOURCE_FIELDS = ("id", "url", "title", "publisher", "date", "engines", "hardware", "tables")
# deployment_flags.engine: the lab's engine keys, each one engine generation
ENGINE_KEYS = ENGINES
# a batch or concurrency at or below this is the low end of the load range
BATCH_ONE = 1


@dataclass(frozen=True)
class SourceFile:
    id: str
    url: str
    title: str
    publisher: str
    date: str
    engines: tuple[str, ...]
    hardware: tuple[str, ...]
    tables: str
    points: tuple[ReferencePoint, ...]


def parse_source(doc: dict, stem: str) -> SourceFile:
    header = doc.get("source", {})
    missing = [f for f in SOURCE_FIELDS if f not in header]
    if missing:
        raise ReferenceDataError(f"{stem}: source header misses {', '.join(missing)}")
    if header["id"] != stem:
        raise ReferenceDataError(f"{stem}: source id {header['id']!r} differs from the file name")
    points = tuple(parse_point(e, check_catalog=False) for e in doc["points"])
    if not points:
        raise ReferenceDataError(f"{stem}: no points")
    return SourceFile(**{**{f: header[f] for f in SOURCE_FIELDS}, "engines": tuple(header["engines"]),
                         "hardware": tuple(header["hardware"]), "points": points})


@cache
def load_sources() -> tuple[SourceFile, ...]:
    sources = []
    for path in sorted(REFERENCE_DIR.glob("*.json")):
        if path != REJECTED_FILE:
            with open(path) as f:
                sources.append(parse_source(json.load(f), path.stem))
    check_unique_ids([p for s in sources for p in s.points])
    return tuple(sources)


def all_points() -> tuple[ReferencePoint, ...]:
    return tuple(p for s in load_sources() for p in s.points)


def source_of(point_id: str) -> str:
    return next(s.id for s in load_sources() if any(p.id == point_id for p in s.points))


@cache
def load_rejected() -> tuple[dict, ...]:
    """Sources left out: each with url, title and why (it cannot be represented honestly)."""
    with open(REJECTED_FILE) as f:
        entries = tuple(json.load(f)["rejected"])
    for e in entries:
        if not {"url", "title", "why"} <= set(e):
            raise ReferenceDataError(f"rejected entry {e.get('title', e)!r} needs url, title and why")
    return entries


def set_gaps(p: ReferencePoint) -> list[str]:
    """What the lab lacks to simulate the point: catalog entries, workload features, and an engine key the
    shipped calibration has no constants for."""
    engine = p.deployment_flags["engine"]
    known = load_calibration(DEFAULT_CALIBRATION).engines()
    missing = [] if engine in known else [f"engine key {engine!r} not in calibration {DEFAULT_CALIBRATION!r}"]
    return lab_gaps(p) + missing


def precision(p: ReferencePoint) -> str:
    return p.deployment_flags.get("quantization") or p.dtype


def context_bucket(p: ReferencePoint) -> str:
    """By the longest context a request reaches (input + output), for fixed lengths; a dataset is '<=2k'."""
    s = p.workload.simulate
    if s.input_len is None:
        return "dataset (<=2k)"
    total = s.input_len + (s.output_len or 0)
    return next(name for name, top in (("<=2k", 2048), ("2k-8k", 8192), ("8k-16k", 16384), (">=16k", float("inf")))
                if total <= top)


def pd_ratio(p: ReferencePoint) -> str:
    return "colocated" if p.disaggregation is None else f"{p.disaggregation[0]}P:{p.disaggregation[1]}D"


def load_level(p: ReferencePoint) -> str:
    """batch 1 (one request alone), a batch or concurrency, a finite rate, or saturation (all at once)."""
    w = p.workload
    if w.max_concurrency is not None:
        b = w.max_concurrency
        return next(name for name, top in (("batch 1", BATCH_ONE), ("batch 2-8", 8), ("batch 9-64", 64),
                                           ("batch >64", float("inf"))) if b <= top)
    return "saturation (all at once)" if w.request_rate == float("inf") else "finite rate"


def summary(points=None) -> dict:
    points = all_points() if points is None else points
    sources = load_sources()
    count = lambda key: dict(sorted(Counter(key(p) for p in points).items()))  # noqa: E731
    return {
        "points": len(points), "sources": len(sources), "rejected": len(load_rejected()),
        "by_source": {s.id: len(s.points) for s in sources},
        "by_precision": count(precision), "by_engine_key": count(lambda p: p.deployment_flags["engine"]),
        "by_engine_version": count(lambda p: f"{p.engine} {p.engine_version}"),
        "by_gpu": count(lambda p: p.gpu), "by_tp": count(lambda p: p.tp), "by_context": count(context_bucket),
        "by_pd": count(pd_ratio), "by_load": count(load_level), "by_metric": count(lambda p: p.metric.name),
        "lab_gaps": dict(sorted(Counter(g for p in points for g in set_gaps(p)).items())),
    }


def format_summary(s: dict) -> str:
    lines = [f"{s['points']} points from {s['sources']} sources ({s['rejected']} sources rejected)"]
    for key, title in (("by_source", "source"), ("by_precision", "precision"), ("by_engine_key", "engine key"),
                       ("by_engine_version", "engine and version"), ("by_gpu", "GPU"), ("by_tp", "TP"),
                       ("by_context", "context (input + output)"), ("by_pd", "prefill:decode"),
                       ("by_load", "load"), ("by_metric", "metric"), ("lab_gaps", "what the lab lacks (points)")):
        lines.append(f"\n{title}:")
        lines += [f"  {k:<60} {v}" for k, v in s[key].items()] or ["  (none)"]
    return "\n".join(lines)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def format_readme() -> str:
    """data/reference/README.md: every source (URL, tables, engine and version, date, hardware) and every
    rejected one with its reason."""
    s = summary()
    lines = [
        "# Reference set: published GPU serving measurements",
        "",
        "One JSON file per source document: its header (`source`: id, URL, title, publisher, date, engines with",
        "versions, hardware, the tables read) and its points (the format of `servelab.lab.catalog.reference`: model,",
        "GPU, TP, engine and flags, workload lengths / rate / batch, metric, published value, the table cell it was",
        "read from). Values are as published; a source that cannot be represented honestly is in `rejected.json`",
        "with the reason. `reference.FIT_SOURCES` names the sources the shipped calibration is fitted to.",
        "",
        "```bash",
        "python -m servelab.lab.catalog.reference_files                 # counts: precision, engine, GPU, context, P:D, load",
        "python -m servelab.lab.catalog.reference_files --write-readme  # this file",
        "```",
        "",
        f"{s['points']} points from {s['sources']} sources; {s['rejected']} sources rejected.",
        "",
        "## Sources",
        "",
        "| id | points | publisher | date | engine (version) | hardware | tables read |",
        "|---|---|---|---|---|---|---|",
    ]
    for src in load_sources():
        lines.append(f"| `{src.id}` [link]({src.url}) | {len(src.points)} | {_cell(src.publisher)} | {_cell(src.date)} "
                     f"| {_cell('; '.join(src.engines))} | {', '.join(src.hardware)} | {_cell(src.tables)} |")
    lines += ["", "Full URLs:", ""] + [f"- `{src.id}`: {src.url}" for src in load_sources()]
    lines += ["", "## Rejected sources", "", "| source | why it is left out |", "|---|---|"]
    lines += [f"| [{_cell(e['title'])}]({e['url']}) | {_cell(e['why'])} |" for e in load_rejected()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write-readme", action="store_true", help=f"write {README_FILE.name} from the source headers")
    args = ap.parse_args(argv)
    if args.write_readme:
        README_FILE.write_text(format_readme())
        print(f"wrote {README_FILE}")
        return 0
    s = summary()
    print(json.dumps(s, indent=1) if args.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
