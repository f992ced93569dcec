"""GPU prices: data/prices.json (cited on-demand $/GPU-hour per catalog GPU), replaced by a file of the same
shape (`--prices FILE`) and then by single overrides (`--price GPU=USD`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from servelab.errors import FieldError
from servelab.lab.catalog.lookup import DATA_DIR, gpu_ids


@dataclass(frozen=True)
class GpuPrice:
    gpu: str
    usd_per_gpu_hour: float
    provider: str = ""
    date: str = ""
    source: str = ""  # the price page (or "override" for --price)

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "usd_per_gpu_hour": self.usd_per_gpu_hour, "provider": self.provider,
                "date": self.date, "source": self.source}


def read_price_file(path: Path) -> dict[str, GpuPrice]:
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise FieldError(f"{{prices}}: cannot read {path}: {err}", "prices") from None
    if not isinstance(entries, dict):
        raise FieldError(f"{{prices}}: {path} must hold an object of GPU -> {{{{\"usd_per_gpu_hour\": ...}}}}",
                         "prices")
    out = {}
    for gpu, e in entries.items():
        if gpu.startswith("_"):
            continue
        usd = e.get("usd_per_gpu_hour") if isinstance(e, dict) else e
        if not isinstance(usd, (int, float)) or isinstance(usd, bool) or usd <= 0:
            raise FieldError(f"{{prices}}: {path}: {gpu} needs a positive usd_per_gpu_hour", "prices")
        e = e if isinstance(e, dict) else {}
        out[gpu] = GpuPrice(gpu, float(usd), e.get("provider", ""), e.get("date", ""), e.get("source", ""))
    return out


def parse_price_overrides(texts: list[str]) -> dict[str, float]:
    """["h100=2.5", ...] -> {"h100": 2.5}."""
    out = {}
    for text in texts:
        gpu, sep, usd = text.partition("=")
        try:
            value = float(usd)
        except ValueError:
            value = -1.0
        if not sep or value <= 0:
            raise FieldError(f"{{price}} expects GPU=USD per GPU-hour (e.g. h100=2.49), got {text!r}", "price")
        out[gpu.strip()] = value
    return out


def load_prices(path: Path | None = None, overrides: dict[str, float] | None = None) -> dict[str, GpuPrice]:
    """The shipped prices (or path's), with overrides on top. Unknown GPU ids are an error."""
    prices = read_price_file(path or DATA_DIR / "prices.json")
    known = set(gpu_ids())
    for gpu, usd in (overrides or {}).items():
        if gpu not in known:
            raise FieldError(f"{{price}}: unknown GPU {gpu!r}; choose one of {', '.join(sorted(known))}", "price")
        prices[gpu] = GpuPrice(gpu, usd, source="override")
    return prices


def price_of(prices: dict[str, GpuPrice], gpu: str) -> GpuPrice:
    if gpu not in prices:
        raise FieldError(f"no price for {gpu}: the catalog cites none; give one with {{price}} {gpu}=USD", "price")
    return prices[gpu]
