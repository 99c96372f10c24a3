"""What a row asks of the engine beyond its prompt, built in one place and honoured or refused.

A row's sampling fields come from three places, later ones winning: the spec's defaults
(`model.sampling`, and the older `model.maxTokens`/`temperature`/`seed`; where neither sets
one of these three, `SPEC_DEFAULTS`), then the row itself, either the body of an OpenAI
batch line (`top_p`, `stop`, ...) or a sampling column of a JSONL or Parquet row
(`input.samplingField`, default ``sampling``, with the spec's camelCase keys). Every field
is checked here; a field nobody knows is an ``invalid_request`` error row naming it. Each
engine says which fields it honours (`Engine.honours`); a row that asks for one it does
not honour gets an ``unsupported`` error row naming the engine and the field, and is never
answered as if it had not asked.

A field set to its neutral value (``n: 1``, ``top_p: 1``, ``presence_penalty: 0``,
``stop: []``, ...) asks for nothing: every engine does that already, so it is never
refused (OpenAI clients often send such defaults explicitly).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

# Capabilities beyond sampling that a request may need (checked like sampling fields).
IMAGES = "images"
ADAPTERS = "adapters"  # a row that names a LoRA adapter
TOKEN_IDS = "tokenIds"  # a prompt given as token ids (an OpenAI `prompt` or `input` of integers)


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling fields a row sets; None means "not set here" (the spec's or the engine's default)."""

    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: tuple[str, ...] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # (kind, text): ("json_schema", the schema as canonical JSON), ("json_object", ""),
    # ("regex", pattern), ("choice", a JSON list of strings) or ("grammar", EBNF).
    structured_output: tuple[str, str] | None = None
    # vLLM's own fields: at least this many tokens, EOS ignored, biases per token id, words never written.
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    bad_words: tuple[str, ...] | None = None
    # Chat prompts: variables the chat template reads (JSON text of an object), and how it ends:
    # with the generation prompt (the default), or open, the last (assistant) message continued.
    chat_template_kwargs: str | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # Embeddings: the first this many dimensions, renormalised (models that declare Matryoshka ones).
    dimensions: int | None = None

    def over(self, base: Sampling) -> Sampling:
        """These fields where set, `base`'s elsewhere."""
        changes = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        return replace(base, **changes) if changes else base

    def asked(self) -> frozenset[str]:
        """The camelCase names of the fields that ask for something (set, and not neutral)."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != NEUTRAL.get(f.name, object()):
                out.append(CAMEL[f.name])
        return frozenset(out)


NO_SAMPLING = Sampling()

# What a row runs with when neither model.sampling nor model.maxTokens/temperature/seed sets these.
# Applied here (`spec_defaults`), never as the spec's or the CRD's defaults: after the API server's
# defaulting a spec must still tell what its user set (model.X and model.sampling.X may not both be).
DEFAULT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_SEED = 0
SPEC_DEFAULTS = Sampling(max_tokens=DEFAULT_MAX_TOKENS, temperature=DEFAULT_TEMPERATURE, seed=DEFAULT_SEED)


@dataclass(frozen=True, slots=True)
class Basics:
    """The maxTokens, temperature and seed every request of a job defaults to (each one resolved)."""

    max_tokens: int
    temperature: float
    seed: int


def spec_defaults(own: Sampling, older: Sampling) -> Sampling:
    """Every row's sampling defaults from the spec: `own` (model.sampling and model.structuredOutput),
    then `older` (model.maxTokens/temperature/seed), then `SPEC_DEFAULTS`: maxTokens, temperature and
    seed are always set."""
    return own.over(older).over(SPEC_DEFAULTS)


def basics(s: Sampling) -> Basics:
    """`s`'s maxTokens, temperature and seed, `SPEC_DEFAULTS`' where `s` leaves one unset."""
    return Basics(max_tokens=DEFAULT_MAX_TOKENS if s.max_tokens is None else s.max_tokens,
                  temperature=DEFAULT_TEMPERATURE if s.temperature is None else s.temperature,
                  seed=DEFAULT_SEED if s.seed is None else s.seed)

# Values that change nothing: every engine "honours" them by doing what it always does.
NEUTRAL: dict[str, Any] = {
    "top_p": 1.0, "top_k": 0, "min_p": 0.0, "stop": (), "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "n": 1, "logprobs": False, "top_logprobs": 0,
    "min_tokens": 0, "ignore_eos": False, "logit_bias": (), "bad_words": (), "chat_template_kwargs": "{}",
    "add_generation_prompt": True, "continue_final_message": False,
}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


CAMEL = {f.name: _camel(f.name) for f in fields(Sampling)}
SNAKE = {v: k for k, v in CAMEL.items()}
# Every field an engine can be asked to honour: sampling fields and capabilities.
ALL_FIELDS: tuple[str, ...] = (*CAMEL.values(), IMAGES, ADAPTERS, TOKEN_IDS)


class BadField(ValueError):
    """A sampling field with a wrong value; the message names the field as the row spelled it."""


def _number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str, Any], float]:
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise BadField(f"{name} must be a number, got {_show(v)}")
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            left = "(" if lo_open else "["
            raise BadField(f"{name} must be in {left}{lo if lo is not None else '-inf'}, "
                           f"{hi if hi is not None else 'inf'}], got {v}")
        return float(v)
    return check


# Every integer field fits the engines' 64-bit integers (seeds: torch's generators take unsigned ones too).
INT64 = (-(2**63), 2**63 - 1)
SEED_RANGE = (-(2**63), 2**64 - 1)


def _integer(lo: int | None = None, hi: int | None = None) -> Callable[[str, Any], int]:
    low = INT64[0] if lo is None else lo
    high = INT64[1] if hi is None else hi

    def check(name: str, v: Any) -> int:
        # orjson reads an integer beyond 64 bits as a float, the stdlib (a line with a NaN) as an int:
        # either way it is refused here alike, by its range.
        if isinstance(v, float) and v.is_integer() and not low <= v <= high:
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadField(f"{name} must be an integer, got {_show(v)}")
        if v < low or v > high:
            span = f"at least {lo}" if hi is None and v < low else f"from {low} to {high}"
            raise BadField(f"{name} must be an integer {span}, got {_show(v)}")
        return v
    return check


def _stop(name: str, v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise BadField(f"{name} must be a non-empty string or a list of them, got {_show(v)}")
    return tuple(v)


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise BadField(f"{name} must be true or false, got {_show(v)}")
    return v


def _logit_bias(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI `logit_bias`: token ids (JSON keys, so strings) to a bias from -100 to 100, sorted by id."""
    if not isinstance(v, dict):
        raise BadField(f"{name} must be an object of token ids to biases, got {_show(v)}")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()) or int(key) > INT64[1]:
            raise BadField(f"{name}: key {_show(key)} is not a token id (a non-negative integer)")
        out[int(key)] = _number(-100, 100)(f"{name}[{key!r}]", bias)
    return tuple(sorted(out.items()))


def _words(name: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
        raise BadField(f"{name} must be a list of non-blank strings, got {_show(v)}")
    return tuple(v)


# Names the tokenizer's apply_chat_template takes itself: never template variables.
_NOT_VARIABLES = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_kwargs(name: str, v: Any) -> str:
    if not isinstance(v, dict):
        raise BadField(f"{name} must be an object of chat template variables, got {_show(v)}")
    taken = sorted(k for k in v if k in _NOT_VARIABLES)
    if taken:
        raise BadField(f"{name}.{taken[0]} is not a chat template variable")
    return json.dumps(v, separators=(",", ":"), ensure_ascii=False)


STRUCTURED_KINDS = {"jsonSchema": "json_schema", "jsonObject": "json_object", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}


def _structured(name: str, v: Any) -> tuple[str, str]:
    """`structuredOutput`: an object with exactly one of jsonSchema, jsonObject (true), regex, choice, grammar."""
    keys = list(v) if isinstance(v, dict) else []
    if len(keys) != 1 or keys[0] not in STRUCTURED_KINDS:
        raise BadField(f"{name} must be an object with exactly one of {', '.join(STRUCTURED_KINDS)}, got {_show(v)}")
    key = keys[0]
    value = v[key]
    kind = STRUCTURED_KINDS[key]
    if kind == "json_schema":
        return kind, json_schema_text(f"{name}.{key}", value)
    if kind == "json_object":
        if value is not True:
            raise BadField(f"{name}.{key} must be true")
        return kind, ""
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise BadField(f"{name}.{key} must be a non-empty list of non-empty strings, got {_show(value)}")
        return kind, json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str) or not value:
        raise BadField(f"{name}.{key} must be a non-empty string, got {_show(value)}")
    return kind, value


def json_schema_text(name: str, schema: Any) -> str:
    """A JSON Schema checked against its metaschema, as compact JSON (its keys in their order: properties
    come out in the order the schema gives them)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise BadField(f"{name} must be a JSON Schema object, got {_show(schema)}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise BadField(f"{name} is not a valid JSON Schema: {e.message}") from None
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# How each field is checked (OpenAI's and vLLM's ranges).
CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": _integer(1),
    "temperature": _number(0, 2),
    "seed": _integer(*SEED_RANGE),
    "top_p": _number(0, 1, lo_open=True),
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "stop": _stop,
    "presence_penalty": _number(-2, 2),
    "frequency_penalty": _number(-2, 2),
    "repetition_penalty": _number(0, 2, lo_open=True),
    "n": _integer(1, 128),
    "logprobs": _flag,
    "top_logprobs": _integer(0, 20),
    "structured_output": _structured,
    "min_tokens": _integer(0),
    "ignore_eos": _flag,
    "logit_bias": _logit_bias,
    "bad_words": _words,
    "chat_template_kwargs": _template_kwargs,
    "add_generation_prompt": _flag,
    "continue_final_message": _flag,
    "dimensions": _integer(1),
}


def _finish(values: dict[str, Any], spelled: Mapping[str, str]) -> Sampling:
    if values.get("top_k") == -1:  # vLLM's spelling of "no top-k"
        values["top_k"] = 0
    if values.get("top_logprobs") and not values.get("logprobs"):
        raise BadField(f"{spelled['top_logprobs']} needs {spelled['logprobs']} true")
    if values.get("continue_final_message") and values.get("add_generation_prompt"):
        # vLLM's rule: an open last message and a new generation prompt after it contradict each other.
        raise BadField(f"{spelled['continue_final_message']} and {spelled['add_generation_prompt']} cannot both "
                       f"be true")
    return Sampling(**values)


def from_column(value: Any, column: str) -> Sampling:
    """The sampling column of a JSONL or Parquet row (camelCase keys, as in `model.sampling`).

    Null values are unset (a Parquet struct column has every key, null where a row sets none).
    """
    if value is None:
        return NO_SAMPLING
    if not isinstance(value, dict):
        raise BadField(f"field {column!r} must be an object of sampling fields, got {_show(value)}")
    values: dict[str, Any] = {}
    spelled = {k: f"{column}.{v}" for k, v in CAMEL.items()}
    for key, v in value.items():
        name = SNAKE.get(key)
        if name is None:
            raise UnknownField(f"{column}.{key}", sorted(CAMEL.values()))
        if v is not None:
            values[name] = CHECKS[name](spelled[name], v)
    return _finish(values, spelled)


def from_spec(value: Mapping[str, Any]) -> Sampling:
    """`model.sampling` of the spec (already checked by the spec model) as a Sampling."""
    values = {SNAKE[k] if k in SNAKE else k: v for k, v in value.items() if v is not None}
    if "stop" in values:
        values["stop"] = _stop("model.sampling.stop", values["stop"])
    if "structured_output" in values:
        values["structured_output"] = _structured("model.structuredOutput", values["structured_output"])
    return _finish(values, {k: f"model.sampling.{v}" for k, v in CAMEL.items()})


class UnknownField(ValueError):
    """A field bij does not know."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        super().__init__(f"unknown field {name!r} (known: {', '.join(known)})")


# OpenAI request bodies: the fields each endpoint takes that bij reads (content, sampling), the
# ones it reads and that change nothing in the answer, and the ones it knows and honours nowhere.
OPENAI_SAMPLING = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "seed": "seed", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "n": "n", "logprobs": "logprobs", "top_logprobs": "top_logprobs",
    "logit_bias": "logit_bias",
    # vLLM's extra sampling fields (its OpenAI server takes them in the body).
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "bad_words": "bad_words",
}
# vLLM's extra chat fields: how the chat template renders the messages.
OPENAI_CHAT = {"chat_template_kwargs": "chat_template_kwargs", "add_generation_prompt": "add_generation_prompt",
               "continue_final_message": "continue_final_message"}
# The body fields each endpoint reads into a row's Sampling.
OPENAI_FIELDS: dict[str, dict[str, str]] = {
    "chat": {**OPENAI_SAMPLING, **OPENAI_CHAT}, "generate": OPENAI_SAMPLING, "embed": {"dimensions": "dimensions"},
}
# `model`: the answer names the model that ran (spec.model.name); `user`: an end-user id for abuse
# tracking, no effect on the answer.
OPENAI_NO_EFFECT = frozenset({"model", "user"})
# Chat: the messages, and the tool and reasoning fields (read by tools.py).
OPENAI_CONTENT = {"chat": frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}),
                  "generate": frozenset({"prompt"}), "embed": frozenset({"input"})}
# /v1/embeddings: how the vectors are written (OpenAI's two).
ENCODINGS = ("float", "base64")
# Known OpenAI fields no engine here honours (yet): a row that sets one (to anything but its
# neutral value) is unsupported, never answered without it.
OPENAI_UNHONOURED: dict[str, Any] = {
    "tools": [], "tool_choice": "none",
    "parallel_tool_calls": None, "functions": [], "function_call": "none", "stream": False,
    "stream_options": None, "modalities": ["text"], "audio": None, "prediction": None,
    "reasoning_effort": None, "service_tier": None, "store": False, "metadata": None,
    "web_search_options": None, "best_of": 1, "echo": False, "suffix": None, "verbosity": None,
}


@dataclass(frozen=True, slots=True)
class OpenAIAsk:
    """What an OpenAI body asks beyond its content: sampling, and fields no engine honours."""

    sampling: Sampling
    unhonoured: tuple[str, ...]  # body fields set that no engine here honours
    spelled: dict[str, str]  # camelCase field -> the body field that set it (for messages)
    encoding: str = "float"  # /v1/embeddings: encoding_format


def from_openai(body: Mapping[str, Any], kind: str) -> OpenAIAsk:
    """The sampling fields of an OpenAI request body (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/embeddings``); raises UnknownField or BadField naming the body field."""
    values: dict[str, Any] = {}
    spelled: dict[str, str] = {k: f"body.{k}" for k in CAMEL}
    unhonoured = []
    encoding = "float"
    content = OPENAI_CONTENT[kind]
    known = OPENAI_FIELDS[kind]
    for key, v in body.items():
        if key in content or key in OPENAI_NO_EFFECT:
            continue
        if key == "response_format" and kind != "embed":
            if v is not None:
                st = _response_format(v)
                if st is not None:
                    values["structured_output"] = st
                    spelled["structured_output"] = "body.response_format"
            continue
        if key == "encoding_format" and kind == "embed":
            if v is not None:
                if v not in ENCODINGS:
                    raise BadField(f"body.encoding_format must be float or base64, got {_show(v)}")
                encoding = v
            continue
        name = known.get(key)
        if name is not None:
            if v is None:
                continue
            where = f"body.{key}"
            if name == "logprobs" and kind == "generate":
                # /v1/completions: logprobs is how many top tokens to return per position.
                k = _integer(0, 5)(where, v)
                values["logprobs"], values["top_logprobs"] = k > 0, k
                spelled["logprobs"] = spelled["top_logprobs"] = where
                continue
            if name in values:
                raise BadField(f"body sets {spelled[name]} and {where}: set one")
            values[name] = CHECKS[name](where, v)
            spelled[name] = where
        elif key in OPENAI_UNHONOURED:
            if v is not None and v != OPENAI_UNHONOURED[key]:
                unhonoured.append(f"body.{key}")
        else:
            extra = {"response_format"} if kind != "embed" else {"encoding_format"}
            raise UnknownField(f"body.{key}", sorted({*content, *OPENAI_NO_EFFECT, *known, *extra}))
    if kind == "chat" and "top_logprobs" in values and "logprobs" not in values:
        raise BadField("body.top_logprobs needs body.logprobs true")
    if values.get("continue_final_message") and "add_generation_prompt" not in values:
        # An open last message takes no new generation prompt after it (vLLM asks for both fields).
        values["add_generation_prompt"] = False
        spelled["add_generation_prompt"] = "body.continue_final_message"
    sampling = _finish(values, spelled)
    return OpenAIAsk(sampling, tuple(unhonoured), {CAMEL[k]: v for k, v in spelled.items() if k in values}, encoding)


def _response_format(v: Any) -> tuple[str, str] | None:
    """OpenAI `response_format`: text (asks nothing), json_object, or json_schema {name, schema, strict}."""
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise BadField("body.response_format.json_schema must be an object with a schema")
        # strict true or false: the schema is enforced either way (constrained decoding is strict).
        return "json_schema", json_schema_text("body.response_format.json_schema.schema", spec["schema"])
    raise BadField(f"body.response_format.type must be text, json_object or json_schema, got {_show(kind)}")


# A row's n x maxTokens x (1 + topLogprobs) at most, unless model.rowBudget says otherwise.
DEFAULT_ROW_BUDGET = 1 << 20


def over_budget(max_tokens: int, s: Sampling, budget: int, spelled: Mapping[str, str], prompts: int = 1) -> str | None:
    """Why a row asking for `max_tokens` with sampling `s` costs more than `budget` (model.rowBudget):
    prompts x n x maxTokens x (1 + topLogprobs when it asks for logprobs), naming the fields; None when
    it fits. `prompts`: how many prompts the row holds (an OpenAI list `prompt`)."""
    n = s.n or 1
    top = (s.top_logprobs or 0) if s.logprobs else 0
    cost = prompts * n * max_tokens * (1 + top)
    if cost <= budget:
        return None
    parts = [f"{spelled.get('maxTokens', 'maxTokens')} {max_tokens}"]
    if n > 1:
        parts.insert(0, f"{spelled.get('n', 'n')} {n}")
    if prompts > 1:
        parts.insert(0, f"{spelled.get('prompts', 'prompts')} {prompts}")
    if s.logprobs:
        parts.append(f"1 + {spelled.get('topLogprobs', 'topLogprobs')} {top}")
    return f"this row costs {' x '.join(parts)} = {cost} generated token places, over model.rowBudget ({budget})"


def refusal(engine: str, asked: frozenset[str], honours: frozenset[str], spelled: Mapping[str, str]) -> str | None:
    """The `unsupported` message when `engine` cannot honour every asked field, else None."""
    missing = sorted(asked - honours)
    if not missing:
        return None
    names = ", ".join(dict.fromkeys(spelled.get(m, m) for m in missing))
    return f"engine {engine} cannot honour {names}"
