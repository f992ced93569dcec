"""Tokenizer on the `tokenizers` library with transformers-compatible encode, decode and chat templates."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as _BackendTokenizer

# Prompt tokens decoded ahead of the first output token, so context-dependent decoders
# (a leading space, a character split over tokens) render the first delta correctly.
_INITIAL_DETOKENIZATION_OFFSET = 5


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e


def _token_str(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as serialized AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: Path, config: dict) -> str | None:
    # transformers reads a standalone chat_template.jinja in preference to the config entry.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}` marks assistant text for training masks; rendering keeps its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode like transformers' AutoTokenizer on the same folder, without importing transformers.

    BOS/EOS come only from tokenizer.json's post-processor, as in transformers 5: it ignores
    tokenizer_config.json's add_bos_token/add_eos_token whenever a tokenizer.json exists.
    """

    def __init__(self, backend: _BackendTokenizer, config: dict, generation_config: dict,
                 chat_template: str | None, name: str = "") -> None:
        self._backend = backend
        self._config = config
        self._chat_template = chat_template
        self._compiled_template = None
        self.name = name
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.unk_token = _token_str(config.get("unk_token"))
        self.pad_token = _token_str(config.get("pad_token"))
        self.bos_token_id = self._token_id(self.bos_token)
        if self.bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_token_id = generation_config["bos_token_id"]
        eos_ids = [self._token_id(self.eos_token)]
        gen_eos = generation_config.get("eos_token_id")
        eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos_ids if i is not None))

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {folder}")
        try:
            backend = _BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"cannot load {path}: {e}") from e
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        return cls(backend, config, _read_json(folder / "generation_config.json"),
                   _chat_template(folder, config), name=str(folder))

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (llguidance builds its token trie from it)."""
        return self._backend.to_str()

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        if self._chat_template is None:
            raise ValueError(f"model {self.name or '(unnamed)'} has no chat template; "
                             "send a plain completion prompt instead of chat messages")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self._chat_template)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "unk_token": self.unk_token, "pad_token": self.pad_token}
        variables.update(template_kwargs)
        return self._compiled_template.render(messages=messages, tools=tools, documents=None,
                                              add_generation_prompt=add_generation_prompt, **variables)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never emitting half a UTF-8 character.

    Follows vLLM's prefix/read offsets: `add` decodes ids[prefix_offset:] and returns what goes
    beyond ids[prefix_offset:read_offset]; text ending in U+FFFD (an incomplete byte sequence) is
    held back until a later token completes it. A stream that ends mid-character never emits it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_INITIAL_DETOKENIZATION_OFFSET:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self.text += delta
        return delta
