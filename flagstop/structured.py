"""Structured outputs: the one canonical form of a request's output constraint
(`Constraint`), its wire form, and the grammar engine's check of it.

The engine is llguidance, measured beside xgrammar on this CPU (make bench-structured,
bench/results/structured.md): xgrammar's masks are cheaper (33 vs 56 us a token on
the embedded vocabulary; 4-37 vs 30-132 us on a 32k one) and it compiles a little
faster, but 115 of 200 random walks through the test schema ended in output that
json.loads refuses: raw control characters in length-bounded strings
(mlc-ai/xgrammar#800, fix unreleased) and UTF-8 no decoder takes (overlong forms such
as E0 99 AA, encoded surrogates). llguidance: 0 of 200. Output that parses is the
point, and masking 16 rows costs 0.25 ms a step (the tiny model's steps: 1-8 ms).

The router checks a constraint (no tokenizer needed: 0.2-1.7 ms, once per constraint) to
refuse a bad one before admission; the executor compiles it against the model's
vocabulary (executor/grammar_book.py). The engine is imported on first use."""

import dataclasses
import functools
import json
from dataclasses import dataclass

from flagstop.v1 import generation_pb2

JSON_SCHEMA, REGEX, EBNF, LARK = "json_schema", "regex", "ebnf", "lark"
NONE = ""  # no constraint: a thinking-token budget alone
ANY_JSON_OBJECT = '{"type":"object"}'
MAX_SPEC_CHARS = 1 << 17  # 128k characters of schema or grammar text
MAX_CHOICES = 1024


class GrammarError(ValueError):
    """A constraint that cannot be used, with a message a person can act on."""


@dataclass(slots=True, frozen=True)
class Constraint:
    kind: str  # JSON_SCHEMA, REGEX, EBNF or LARK
    text: str  # canonical: a JSON schema is re-serialized compactly
    strict: bool = True  # json_schema: only the listed properties and items
    # The tokens after whose first appearance the constraint applies (the end of the
    # model's reasoning); empty: from the first token.
    after_token_ids: tuple[int, ...] = ()
    # Forced when they have not appeared within this many output tokens; 0: never.
    force_after_within: int = 0
    # The budget counts from these when the output starts with them (else never).
    open_token_ids: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        """What compiled grammars are cached by (the trigger is not part of them)."""
        return f"{self.kind}:{int(self.strict)}:{self.text}"


def constraint_from_proto(message: generation_pb2.StructuredOutputs) -> Constraint:
    """The canonical form of a request's constraint. Raises GrammarError."""
    budget = message.force_after_within
    if message.WhichOneof("kind") is None and message.after_token_ids and budget > 0:
        constraint = Constraint(NONE, "")
    else:
        constraint = _constraint_of_kind(message)
    if message.after_token_ids:
        return dataclasses.replace(
            constraint, after_token_ids=tuple(message.after_token_ids),
            force_after_within=max(0, budget), open_token_ids=tuple(message.open_token_ids),
        )  # fmt: skip
    return constraint


def _constraint_of_kind(message: generation_pb2.StructuredOutputs) -> Constraint:
    kind = message.WhichOneof("kind")
    if kind == "json_schema":
        return Constraint(JSON_SCHEMA, _canonical_schema(message.json_schema), message.strict)
    if kind == "json_object":
        return Constraint(JSON_SCHEMA, ANY_JSON_OBJECT, strict=False)
    if kind == "regex":
        return Constraint(REGEX, _bounded(message.regex, "regex"))
    if kind == "choice":
        return Constraint(LARK, _choice_grammar(list(message.choice.choices)))
    if kind == "grammar":
        text = _bounded(message.grammar, "grammar")
        return Constraint(EBNF if "::=" in text else LARK, text)
    raise GrammarError("structured_outputs sets no constraint: set one of its fields")


def constraint_to_proto(constraint: Constraint) -> generation_pb2.StructuredOutputs:
    after = {"after_token_ids": constraint.after_token_ids,
             "force_after_within": constraint.force_after_within,
             "open_token_ids": constraint.open_token_ids}  # fmt: skip
    if constraint.kind == NONE:
        return generation_pb2.StructuredOutputs(**after)
    if constraint.kind == JSON_SCHEMA:
        return generation_pb2.StructuredOutputs(
            json_schema=constraint.text, strict=constraint.strict, **after
        )
    if constraint.kind == REGEX:
        return generation_pb2.StructuredOutputs(regex=constraint.text, **after)
    return generation_pb2.StructuredOutputs(grammar=constraint.text, **after)


def _bounded(text: str, name: str) -> str:
    if not text.strip():
        raise GrammarError(f"{name} is empty")
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarError(f"{name} is longer than {MAX_SPEC_CHARS} characters")
    return text


def _canonical_schema(text: str) -> str:
    try:
        schema = json.loads(_bounded(text, "json_schema"))
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GrammarError("json_schema must be a JSON object (a JSON Schema document)")
    # Key order stays: a schema's property order is the order the output takes.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _choice_grammar(choices: list[str]) -> str:
    if not choices or any(not c for c in choices):
        raise GrammarError("choice takes a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"choice takes at most {MAX_CHOICES} strings")
    # Lark string literals take JSON's escapes.
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def to_grammar(constraint: Constraint) -> str:
    """The engine's grammar (llguidance's grammar document). Raises GrammarError
    with the engine's message. JSON is compact (no free whitespace): free whitespace
    lets a weak model fill max_tokens with blanks mid-structure, the failure vLLM's
    disable_any_whitespace exists for."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    # The engine's converters raise what their parsers raise (ValueError, a number
    # past 64 bits in a schema: OverflowError, ...): each is a refusal of the constraint.
    try:
        if constraint.kind == JSON_SCHEMA:
            schema = json.loads(constraint.text)
            if constraint.strict:
                schema = _closed_objects(schema)
            return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        if constraint.kind == REGEX:
            return LLMatcher.grammar_from_regex(constraint.text)
        text = gbnf_to_lark(constraint.text) if constraint.kind == EBNF else constraint.text
        return LLMatcher.grammar_from_lark(text)
    except Exception as e:
        raise GrammarError(refusal_of(constraint, str(e) or type(e).__name__)) from None


_COMPACT = {"whitespace_flexible": False}
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _closed_objects(node):
    """strict: an object schema that does not say otherwise takes only its listed
    properties (OpenAI's strict mode requires additionalProperties: false)."""
    if isinstance(node, list):
        return [_closed_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYS else _closed_objects(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_KIND_NAMES = {
    JSON_SCHEMA: "json_schema does not compile",
    REGEX: "regex does not compile",
    EBNF: "grammar (EBNF) does not compile",
    LARK: "grammar (Lark) does not compile",
}


def refusal_of(constraint: Constraint, error: str) -> str:
    """The engine's error, said as a refusal of the request's constraint."""
    return f"{_KIND_NAMES[constraint.kind]}: {error.strip()}"


@functools.lru_cache(maxsize=256)
def check(constraint: Constraint) -> str | None:
    """The refusal of a constraint the engine cannot use, or None: what the router asks
    before admission (no tokenizer needed: 0.2 ms for a small schema). Cached,
    refusals included (a client retrying a bad schema costs a lookup)."""
    from llguidance import LLMatcher

    if constraint.kind == NONE:
        return None
    try:
        error = LLMatcher.validate_grammar(to_grammar(constraint))
    except GrammarError as e:
        return str(e)
    except Exception as e:  # the engine's own parser, on input it chokes on
        return refusal_of(constraint, str(e) or type(e).__name__)
    return refusal_of(constraint, error) if error else None
