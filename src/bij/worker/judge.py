"""Judges decide whether an output is good enough; attempts differ so a retry can succeed.

- ``regex``: approve when the output matches `pattern` (``re.search``, dot matches newlines).
- ``jsonSchema``: approve when the output parses as JSON and validates against `schema`.
- ``llm``: ask the same engine `prompt` (with ``{input}`` and ``{output}`` filled in)
  at temperature 0 and approve when its answer matches `approvePattern`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from bij.contract.spec import JudgeSpec
from bij.engines.base import Engine, Request, request_text

# Temperatures for attempts 1, 2, ... when the spec asks for greedy decoding: a greedy
# retry would repeat the rejected answer word for word.
RETRY_TEMPERATURES = (0.7, 0.9, 1.0, 1.1, 1.2)


@dataclass(frozen=True)
class Verdict:
    approved: bool
    reason: str


def attempt_params(temperature: float, seed: int | None, attempt: int) -> tuple[float, int]:
    """(temperature, seed) for a row's attempt number `attempt` (0 is the first try)."""
    base_seed = seed or 0
    if attempt == 0:
        return temperature, base_seed
    if temperature == 0:
        temperature = RETRY_TEMPERATURES[min(attempt - 1, len(RETRY_TEMPERATURES) - 1)]
    return temperature, base_seed + 1_000_003 * attempt


class Judge:
    """A judge built from the spec's `judge` section."""

    def __init__(self, spec: JudgeSpec):
        self.type = spec.type
        self.pattern = re.compile(spec.pattern, re.DOTALL) if spec.pattern else None
        self.schema = spec.json_schema
        self.prompt = spec.prompt or ""
        self.approve = re.compile(spec.approve_pattern, re.IGNORECASE)
        self._validator: Any = None
        if self.type == "jsonSchema":
            import jsonschema

            cls = jsonschema.validators.validator_for(self.schema)
            self._validator = cls(self.schema)
        self.engine_calls = 0

    def judge(self, requests: list[Request], outputs: list[str], engine: Engine) -> list[Verdict]:
        """One verdict per (request, output)."""
        if self.type == "regex":
            assert self.pattern is not None
            return [Verdict(True, "matches pattern") if self.pattern.search(o)
                    else Verdict(False, "does not match pattern") for o in outputs]
        if self.type == "jsonSchema":
            return [self._json(o) for o in outputs]
        return self._llm(requests, outputs, engine)

    def _json(self, output: str) -> Verdict:
        try:
            doc = json.loads(output)
        except ValueError as e:
            return Verdict(False, f"not JSON: {e}")
        errors = sorted(self._validator.iter_errors(doc), key=lambda e: list(e.path))
        if errors:
            where = "/".join(str(p) for p in errors[0].path) or "(root)"
            return Verdict(False, f"schema: {where}: {errors[0].message}"[:300])
        return Verdict(True, "valid against schema")

    def _llm(self, requests: list[Request], outputs: list[str], engine: Engine) -> list[Verdict]:
        prompts = [
            Request(text=self.prompt.replace("{input}", request_text(r)).replace("{output}", o),
                    max_tokens=16, temperature=0.0, seed=0)
            for r, o in zip(requests, outputs, strict=True)
        ]
        self.engine_calls += len(prompts)
        answers = engine.run(prompts)
        out = []
        for a in answers:
            text = (a.output or "").strip()
            if a.error:
                out.append(Verdict(False, f"judge failed: {a.error}"[:300]))
            else:
                out.append(Verdict(bool(self.approve.search(text)), f"judge said: {text[:200]}"))
        return out
