"""The lab web API's human-readable messages in the page's two languages. A message is a kind with values; its
wording in each language is the `api.<kind>` entry of static/i18n/<lang>.json, the files the page reads too.

The request picks the language with `?lang=` or, failing that, Accept-Language; English otherwise."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from servelab.errors import FieldError

I18N_DIR = Path(__file__).parent / "static" / "i18n"
LANGUAGES = ("en", "zh")
DEFAULT_LANGUAGE = "en"


@dataclass(frozen=True)
class Message:
    kind: str
    values: dict = field(default_factory=dict)

    def render(self, lang: str = DEFAULT_LANGUAGE) -> str:
        return catalogue(lang)[f"api.{self.kind}"].format_map(self.values)


@cache
def catalogue(lang: str) -> dict[str, str]:
    strings = json.loads((I18N_DIR / f"{lang}.json").read_text(encoding="utf-8"))
    return {key: text for key, text in strings.items() if key.startswith("api.")}


def _language_of(tag: str) -> str | None:
    primary = tag.strip().lower().split("-")[0]
    return primary if primary in LANGUAGES else None


def request_language(query_lang: str | None, accept_language: str | None) -> str:
    if query_lang and _language_of(query_lang):
        return _language_of(query_lang)
    ranked = []
    for position, item in enumerate((accept_language or "").split(",")):
        tag, _, params = item.partition(";")
        quality = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if _language_of(tag) and quality > 0:
            ranked.append((-quality, position, _language_of(tag)))
    return min(ranked)[2] if ranked else DEFAULT_LANGUAGE


# The errors that the lab API, the deployment and the workload raise for a web request, read back as kinds with
# values. Their wording belongs to the raising code; one that changes falls back to "invalid" (the English text).
_FIELD_ERRORS = [
    ("not_a_multiple", r"\{num_gpus\} (?P<num_gpus>\d+) is not a multiple of \{tp\} (?P<tp>\d+)"),
    ("tp_attention_heads", r"\{tp\} (?P<tp>\d+) does not divide (?P<model>.+)'s (?P<heads>\d+) attention heads"),
    ("tp_kv_heads", r"\{tp\} (?P<tp>\d+) neither divides nor is a multiple of (?P<model>.+)'s (?P<heads>\d+) KV heads"),
    ("tp_spans_nodes", r"\{tp\} (?P<tp>\d+) spans more than one (?P<gpu>\S+) node \((?P<per_node>\d+) devices\); "
                       r"tensor parallelism needs the intra-node link"),
    ("split_gpus", r"\{disaggregate\} (?P<prefill>\d+):(?P<decode>\d+) with \{tp\} (?P<tp>\d+) needs "
                   r"(?P<needed>\d+) GPUs, not \{num_gpus\} (?P<num_gpus>\d+)"),
    ("split_needs_continuous", r"\{disaggregate\} runs continuous batching on each side"),
    ("sharegpt_input_len", r"sharegpt-like draws prompt lengths from its own distribution; use \{dataset\} random "
                           r"for a fixed \{input_len\}"),
    ("advise_needs_ttft", r"advise needs \{ttft_target_ms\} \(and optionally \{tpot_target_ms\}\)"),
]
_VALUE_ERRORS = [
    ("exceeds_context", r"a request of (?P<num_tokens>\d+) tokens exceeds (?P<model>.+)'s context of "
                        r"(?P<context>\d+)"),
]


def error_message(err: ValueError) -> Message:
    """The message of a lower layer's ValueError; a FieldError's template names the fields as the JSON body does."""
    text, patterns = (err.template, _FIELD_ERRORS) if isinstance(err, FieldError) else (str(err), _VALUE_ERRORS)
    for kind, pattern in patterns:
        match = re.fullmatch(pattern, text)
        if match:
            return Message(kind, match.groupdict())
    field_name = err.field if isinstance(err, FieldError) else None
    message = err.render(str) if isinstance(err, FieldError) else str(err)
    return Message("invalid", {"message": message, "param": field_name or "-"})
