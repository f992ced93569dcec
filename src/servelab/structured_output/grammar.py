"""A request's grammar as llguidance text, with the limits that keep a hostile one cheap: a JSON schema's
nesting depth and size are checked here before llguidance sees it, and llguidance's own parser limits (lexer
fuel, grammar size) bound what compiling and each mask may cost."""
from __future__ import annotations

import json

import llguidance

from servelab.sampling_params import StructuredOutputsParams

MAX_SCHEMA_DEPTH = 64  # nesting of JSON objects and arrays in a schema
MAX_SCHEMA_NODES = 20_000  # values (objects, arrays, strings, numbers) in a schema or choice list
MAX_GRAMMAR_CHARS = 200_000  # text of a regex, Lark or GBNF grammar

# Compact JSON: no free whitespace between tokens, so a model cannot spend its tokens on blank space
# (llguidance allows any whitespace by default; OpenAI's strict outputs are compact too).
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar is malformed, unsatisfiable or over a limit; the message names the problem."""


def parser_limits() -> llguidance.LLParserLimits:
    # llguidance's defaults, stated: building the lexer may take ~20 ms of fuel, one mask ~15 ms at most.
    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     max_grammar_size=500_000)


def _check_json_shape(value: object, what: str) -> None:
    """Depth and size of a decoded JSON value, iteratively (a schema nested thousands deep must not recurse)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    num_nodes = 0
    while stack:
        node, depth = stack.pop()
        num_nodes += 1
        if num_nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"{what} is too large: more than {MAX_SCHEMA_NODES} values")
        if isinstance(node, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise GrammarError(f"{what} is nested too deeply: more than {MAX_SCHEMA_DEPTH} levels")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)


def _decode(spec: str, what: str) -> object:
    try:
        return json.loads(spec)
    except RecursionError as exc:
        raise GrammarError(f"{what} is nested too deeply") from exc
    except ValueError as exc:
        raise GrammarError(f"{what} is not valid JSON: {exc}") from exc


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of params; GrammarError when it is malformed or over a limit (not yet checked
    against the tokenizer: see check_grammar)."""
    kind, spec = params.kind, params.spec
    if kind == "json":
        schema = _decode(spec, "the JSON schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the JSON schema must be an object")
        _check_json_shape(schema, "the JSON schema")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"the {kind} is too long: more than {MAX_GRAMMAR_CHARS} characters")
    if kind == "choice":
        choices = _decode(spec, "the choice list")
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
            raise GrammarError("choice must be a non-empty list of strings")
        _check_json_shape(choices, "the choice list")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    try:
        return llguidance.grammar_from("grammar", spec)  # Lark as it is; GBNF converted to Lark
    except ValueError as exc:
        raise GrammarError(str(exc)) from exc


def check_grammar(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None = None) -> str:
    """The llguidance grammar of params once llguidance has validated it (with the tokenizer when given);
    GrammarError naming the problem otherwise."""
    grammar = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error:
        raise GrammarError(f"invalid {_NAMES[params.kind]}: {error.strip()}")
    return grammar


def compile_matcher(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A matcher for params at its start, once the grammar has been checked and its first mask computed (a
    grammar that can produce nothing, like a schema that is only a reference to itself, fails there);
    GrammarError naming the problem otherwise."""
    grammar = check_grammar(params, tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    for m in (matcher, probe):
        if m.is_error():
            raise GrammarError(f"unusable {_NAMES[params.kind]}: {m.get_error().splitlines()[0]}")
    return matcher


_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}
