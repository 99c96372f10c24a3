"""Which BatchInferenceJob runs a batch: the model map (`models.yaml`, a ConfigMap in the chart).

Each key is a `model` string the API accepts (what the request lines' ``body.model`` says); its
value is the part of a bij spec that decides how it runs: ``model`` (engine, name, vLLM settings),
``workers`` (GPUs, spot, parallelism, env), ``batching``, ``sharding``, ``storage``, ``maxErrorRatio`` and
``canary`` (a batch is ``validating`` while its canary runs, and ``failed`` if the canary stops it)::

    tiny-chat:
      model: {engine: vllm, name: /models/tiny-chat}
      workers: {gpus: 1, spot: true, parallelism: 4}
    support-chat:
      model:
        engine: vllm
        name: /models/llama
        adapters:                      # LoRA adapters of the base model, each a name lines may use
          - {name: support-fr, uri: s3://adapters/support-fr/}

A line's ``body.model`` names an entry (its base model) or one of an entry's ``model.adapters``
(that adapter on the entry's base model); one batch uses one entry, its base and its adapters in
any mix. ``GET /v1/models`` lists every name. The server fills in the rest: the input (the
uploaded file, OpenAI batch lines), the output (under the files prefix), ``model.task`` from the
batch's endpoint, ``model.servedName`` (the entry's key: what lines call the base model) and
``deadlineSeconds`` from its completion window. Every entry is checked at start-up as the bij it
would become for each endpoint; one that no endpoint can run is refused, and a batch whose
endpoint its model cannot serve (chat on an embedding model) is a 400 naming why.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from bij.contract.codes import OPENAI_ENDPOINTS
from bij.contract.spec import BatchInferenceJob, SpecError, parse_job

# The parts of a bij spec a model's entry may set; the server sets the others.
TEMPLATE_KEYS = frozenset({"model", "workers", "batching", "sharding", "storage", "maxErrorRatio", "canary"})


class ModelMapError(ValueError):
    """The model map cannot be used: names the file, the model and the field."""


def job_doc(name: str, namespace: str, template: Mapping[str, Any], *, input_uri: str, output_uri: str,
            task: str, deadline_seconds: int | None, served_name: str | None = None,
            labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The BatchInferenceJob of one batch: `template` (one model's entry) with the batch's input,
    output, task, deadline and the name lines use for its base model (`served_name`, the entry's key)."""
    spec: dict[str, Any] = {k: _copy(v) for k, v in template.items()}
    spec["model"] = {**spec.get("model", {}), "task": task}
    if served_name is not None:
        spec["model"]["servedName"] = served_name
    spec["input"] = {"uri": input_uri, "format": "openai"}
    # Plain JSON lines, so the output and error files are served as stored.
    spec["output"] = {"uri": output_uri, "format": "jsonl", "compression": "none"}
    if deadline_seconds is not None:
        spec["deadlineSeconds"] = deadline_seconds
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if labels:
        meta["labels"] = dict(labels)
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"apiVersion": "batchinference.io/v1alpha1", "kind": "BatchInferenceJob", "metadata": meta, "spec": spec}


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


class ModelMap:
    """The models a batch may ask for, each with its bij template."""

    def __init__(self, entries: Mapping[str, Mapping[str, Any]]):
        self.entries = dict(entries)
        # Every name a line may use -> (its entry's key, the adapter it names or None for the base).
        self.served: dict[str, tuple[str, str | None]] = {key: (key, None) for key in self.entries}
        for key, entry in self.entries.items():
            for adapter in adapters_of(entry):
                self.served[adapter] = (key, adapter)

    @property
    def names(self) -> list[str]:
        """Every name a line may use: entries and their adapters."""
        return sorted(self.served)

    def template(self, model: str) -> Mapping[str, Any] | None:
        return self.entries.get(model)

    def resolve(self, name: str) -> tuple[str, str | None] | None:
        """(entry key, adapter or None) of a name lines use, or None when nothing here has it."""
        return self.served.get(name)

    @classmethod
    def parse(cls, doc: Any, source: str) -> ModelMap:
        """The map in `doc` (parsed YAML), every entry checked as a bij of each endpoint's task."""
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise ModelMapError(f"{source}: must map model names to bij templates, got {type(doc).__name__}")
        for name, entry in doc.items():
            where = f"{source}: model {name!r}"
            if not isinstance(name, str) or not name:
                raise ModelMapError(f"{source}: model names must be non-empty strings, got {name!r}")
            if not isinstance(entry, Mapping):
                raise ModelMapError(f"{where}: must be a mapping of bij spec fields, got {type(entry).__name__}")
            unknown = sorted(set(entry) - TEMPLATE_KEYS)
            if unknown:
                raise ModelMapError(f"{where}: {', '.join(unknown)} cannot be set here (only "
                                    f"{', '.join(sorted(TEMPLATE_KEYS))}; the server sets input, output, task "
                                    "and deadline)")
            # An entry serves the endpoints whose task it can run (an embedding model: /v1/embeddings).
            problems: dict[str, list[str]] = {}
            for task in sorted(set(OPENAI_ENDPOINTS.values())):
                try:
                    check(entry, task, name)
                except SpecError as e:
                    problems[task] = e.problems
            if len(problems) == len(set(OPENAI_ENDPOINTS.values())):
                raise ModelMapError(f"{where}: no endpoint's task can run it: " + "; ".join(
                    f"task {task}: {', '.join(p)}" for task, p in problems.items()))
        # A name lines use must pick one thing: no adapter may share a name with an entry or another's adapter.
        seen: dict[str, str] = {name: f"model {name!r}" for name in doc}
        for name, entry in doc.items():
            for adapter in adapters_of(entry):
                if adapter in seen:
                    raise ModelMapError(f"{source}: model {name!r}: adapter {adapter!r} has the name of "
                                        f"{seen[adapter]}: each name a line may use must be one model's")
                seen[adapter] = f"model {name!r}'s adapter"
        return cls(doc)

    @classmethod
    def load(cls, path: str | Path) -> ModelMap:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ModelMapError(f"{p}: cannot read the model map: {e.strerror}") from None
        try:
            return cls.parse(yaml.safe_load(text), str(p))
        except yaml.YAMLError as e:
            raise ModelMapError(f"{p}: not valid YAML: {e}") from None


def adapters_of(entry: Mapping[str, Any]) -> list[str]:
    """The names of an entry's LoRA adapters (its model.adapters)."""
    model = entry.get("model")
    adapters = model.get("adapters") if isinstance(model, Mapping) else None
    return [str(a["name"]) for a in adapters or [] if isinstance(a, Mapping) and "name" in a]


def check(template: Mapping[str, Any], task: str, served_name: str | None = None) -> BatchInferenceJob:
    """`template` as the bij it would become (SpecError naming the field when it cannot)."""
    doc = job_doc("check", "default", template, input_uri="file:///check/in.jsonl", output_uri="file:///check/out/",
                  task=task, deadline_seconds=None, served_name=served_name)
    return parse_job(doc, "model map")
