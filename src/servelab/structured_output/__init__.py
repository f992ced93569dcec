"""Structured output: grammars (JSON schema, regex, choice, Lark/GBNF) compiled by llguidance, and the per-step
token bitmask that constrains the sampler. grammar.py turns a request's StructuredOutputsParams into an
llguidance grammar and checks it (the API server answers a 400 for a bad one); manager.py owns the compiled
grammars and the requests' matchers inside an engine core."""
from servelab.structured_output.grammar import GrammarError, check_grammar, compile_matcher, grammar_text
from servelab.structured_output.manager import StructuredOutputManager, ll_tokenizer

__all__ = ["GrammarError", "StructuredOutputManager", "check_grammar", "compile_matcher", "grammar_text", "ll_tokenizer"]
