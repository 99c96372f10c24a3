"""The CRD (crds/batchinferencejobs.yaml) and `bij validate`: the API server's verdict offline,
and the pydantic model agreeing with it."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from bij.cli import validate
from bij.cli.main import main as bij_main
from bij.contract.spec import job_to_dict, parse_job

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "batchinferencejobs.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBE_VERSIONS = ["1.31", "1.33"]


def load_sync_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_crd", ROOT / "tools" / "sync_crd.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "batchinference.io/v1alpha1",
        "kind": "BatchInferenceJob",
        "metadata": {"name": "job"},
        "spec": {"input": {"uri": "file:///data/in"}, "output": {"uri": "s3://bucket/out"}},
    }


def with_spec(**patch: Any) -> dict[str, Any]:
    doc = minimal()
    doc["spec"].update(copy.deepcopy(patch))
    return doc


def walk_schema(node: dict[str, Any], path: str = ""):
    """Yield (path, node) for every schema node."""
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from walk_schema(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk_schema(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk_schema(node["additionalProperties"], f"{path}{{}}")


# --- the CRD as an object -------------------------------------------------------------------


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_crd_is_a_valid_apiextensions_v1_object(kube: str) -> None:
    kubernetes_validate.validate(crd(), kube, strict=True)


def test_crd_identity_scope_and_status_subresource() -> None:
    c = crd()
    assert c["metadata"]["name"] == "batchinferencejobs.batchinference.io"
    assert c["spec"]["scope"] == "Namespaced"
    assert c["spec"]["names"]["shortNames"] == ["bij"]
    (version,) = c["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_schema_is_structural() -> None:
    """What the API server demands of a structural schema, checked node by node."""
    schema = validate.crd_schema()
    for path, node in walk_schema(schema):
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path or '<root>'} has no type"
        assert not ({"allOf", "anyOf", "oneOf", "not", "$ref"} & node.keys()), path
        assert not ("properties" in node and "additionalProperties" in node), path
        if node.get("x-kubernetes-list-type") == "map":
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in node["items"].get("required", []) or "default" in node["items"]["properties"][key]


def test_every_default_is_valid_for_its_own_field() -> None:
    for _, node in walk_schema(validate.crd_schema()):
        if "default" in node:
            jsonschema.validate(node["default"], validate._to_json_schema(node))


def test_every_cel_rule_compiles() -> None:
    env = celpy.Environment()
    rules = [r for _, node in walk_schema(validate.crd_schema()) for r in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 12
    for rule in rules:
        env.compile(rule["rule"])
        assert rule["message"], rule


def test_printer_columns_point_at_fields_of_their_type() -> None:
    (version,) = crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns) == ["Phase", "Round", "Shards", "Rows", "Age", "Lanes", "Throughput", "ETA", "Cost", "Output",
                             "Message"]
    assert {n for n, c in columns.items() if c.get("priority") == 1} == {"Lanes", "Throughput", "ETA", "Cost", "Output",
                                                                         "Message"}
    schema = validate.crd_schema()
    for name, column in columns.items():
        if column["jsonPath"] == ".metadata.creationTimestamp":
            continue
        node = schema
        for part in column["jsonPath"].lstrip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == column["type"], name
    assert columns["Shards"]["jsonPath"] == ".status.shardsSummary"


def test_conditions_are_a_list_map_keyed_by_type() -> None:
    conditions = validate.crd_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["properties"]) == {
        "type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"
    }


def test_packaged_crd_copy_is_the_source() -> None:
    sync = load_sync_tool()
    packaged = ROOT / "src" / "bij" / "contract" / "crds" / "batchinferencejobs.yaml"
    assert packaged not in sync.drifted(ROOT), "run: python tools/sync_crd.py"
    assert yaml.safe_load(packaged.read_text()) == crd()


# --- defaults: what the API server stores equals what the model assumes ---------------------


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted path; empty maps and lists count as absent."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    if isinstance(value, list) and not value:
        return {}
    return {prefix: value}


@pytest.mark.parametrize(
    "doc",
    [minimal(), with_spec(model={"task": "generate"}, judge={"type": "regex", "pattern": "ok"})],
    ids=["minimal", "with-judge"],
)
def test_crd_defaults_equal_the_model_defaults(doc: dict[str, Any]) -> None:
    verdicts = validate.check_document(doc)
    assert verdicts.schema == [] and verdicts.stored is not None
    stored = flatten(verdicts.stored["spec"])
    modelled = flatten(job_to_dict(parse_job(doc))["spec"])
    assert stored == modelled


def test_null_is_kept_where_the_schema_is_nullable_and_pruned_elsewhere() -> None:
    doc = with_spec(workers={"ttlSecondsAfterFinished": None, "shmSize": None, "parallelism": None})
    verdicts = validate.check_document(doc)
    assert verdicts.schema == [] and verdicts.stored is not None
    workers = verdicts.stored["spec"]["workers"]
    assert workers["ttlSecondsAfterFinished"] is None and workers["shmSize"] is None
    assert workers["parallelism"] == 4  # pruned, then defaulted
    stored_job = parse_job(verdicts.stored)
    assert stored_job.spec.workers.ttl_seconds_after_finished is None


# --- examples -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_accepted_by_the_crd_and_the_model(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "BatchInferenceJob"]
    assert docs
    for doc in docs:
        verdicts = validate.check_document(doc)
        assert verdicts.schema == [] and verdicts.model == [] and verdicts.model_stored == []


def test_examples_cover_spot_gpus_and_a_judge() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"vllm-generate-spot.yaml", "judge-rounds.yaml"} <= names
    spot = yaml.safe_load((ROOT / "examples" / "vllm-generate-spot.yaml").read_text())["spec"]
    assert spot["workers"]["spot"] and spot["workers"]["gpus"] == 1 and spot["model"]["engine"] == "vllm"
    assert spot["input"]["uri"].startswith("s3://") and spot["output"]["uri"].startswith("s3://")
    judged = yaml.safe_load((ROOT / "examples" / "judge-rounds.yaml").read_text())["spec"]
    assert judged["judge"]["strategy"] == "rounds" and judged["judge"]["maxRounds"] > 1


# --- bad specs: rejected by the CRD, naming the field, and by the model too ---------------

BAD = [
    ("regex-judge-without-pattern", with_spec(model={"task": "generate"}, judge={"type": "regex"}),
     'spec.judge: Invalid value: judge.type regex needs judge.pattern'),
    ("jsonschema-judge-without-schema", with_spec(model={"task": "chat"}, judge={"type": "jsonSchema"}),
     'spec.judge: Invalid value: judge.type jsonSchema needs judge.schema'),
    ("llm-judge-without-prompt", with_spec(model={"task": "generate"}, judge={"type": "llm"}),
     "spec.judge: Invalid value: judge.type llm needs judge.prompt"),
    ("llm-judge-prompt-without-output", with_spec(model={"task": "generate"},
                                                  judge={"type": "llm", "prompt": "Is it good?"}),
     "spec.judge: Invalid value: judge.prompt must contain {output}"),
    ("judge-on-embeddings", with_spec(judge={"type": "regex", "pattern": "x"}),
     "spec.judge: Invalid value: judge needs a generate or chat task"),
    ("judge-without-type", with_spec(model={"task": "generate"}, judge={"pattern": "x"}),
     "spec.judge.type: Required value"),
    ("sentence-transformers-generating", with_spec(model={"engine": "sentence-transformers", "task": "generate"}),
     "spec.model: Invalid value: engine sentence-transformers only supports task embed"),
    ("transformers-embedding", with_spec(model={"engine": "transformers", "task": "embed"}),
     "spec.model: Invalid value: engine transformers supports tasks generate and chat"),
    ("unknown-engine", with_spec(model={"engine": "tgi"}),
     'spec.model.engine: Unsupported value: "tgi": supported values: "echo", "sentence-transformers"'),
    ("hostpath-cache-without-path", with_spec(workers={"modelCache": {"type": "hostPath"}}),
     'spec.workers.modelCache: Invalid value: modelCache.type hostPath needs modelCache.path'),
    ("pvc-cache-without-claim", with_spec(workers={"modelCache": {"type": "pvc", "claimName": ""}}),
     'spec.workers.modelCache: Invalid value: modelCache.type pvc needs modelCache.claimName'),
    ("ftp-input", with_spec(input={"uri": "ftp://example.com/in.jsonl"}),
     'spec.input.uri: Invalid value: "ftp://example.com/in.jsonl": must start with file://, s3://, gs://, https:// or hf://'),
    ("https-input-without-an-object", with_spec(input={"uri": "https://example.com/data/"}),
     'spec.input.uri: Invalid value: "https://example.com/data/": must start with file://, s3://, gs://, https:// or hf://'),
    ("https-output", with_spec(output={"uri": "https://example.com/out/r.jsonl"}),
     'spec.output.uri: Invalid value: "https://example.com/out/r.jsonl": must start with file://, s3:// or gs://'),
    ("vllm-with-a-batch-shape", with_spec(model={"engine": "vllm", "name": "m", "task": "generate"},
                                          batching={"maxBatchSize": 64}),
     "spec.batching: Invalid value: batching.targetBatchTokens and batching.maxBatchSize shape"),
    ("output-with-a-glob", with_spec(output={"uri": "s3://b/out-*/"}),
     'spec.output.uri: Invalid value: "s3://b/out-*/": an output is one folder: no wildcards'),
    ("s3-output-without-bucket", with_spec(output={"uri": "s3://"}),
     'spec.output.uri: Invalid value: "s3://": must start with file://, s3:// or gs://'),
    ("s3-input-with-an-empty-bucket", with_spec(input={"uri": "s3:///"}),
     'spec.input.uri: Invalid value: "s3:///": must start with file://, s3://, gs://, https:// or hf://, as '
     's3://bucket/prefix or gs://bucket/prefix (a bucket)'),
    ("gs-output-without-bucket", with_spec(output={"uri": "gs:///out/"}),
     'spec.output.uri: Invalid value: "gs:///out/": must start with file://, s3:// or gs://, as s3://bucket/prefix or '
     'gs://bucket/prefix (a bucket)'),
    ("file-output-without-path", with_spec(output={"uri": "file://"}),
     'spec.output.uri: Invalid value: "file://": must start with file://, s3:// or gs://'),
    ("endpoint-not-a-url", with_spec(storage={"s3": {"endpointUrl": "not a url::"}}),
     'spec.storage.s3.endpointUrl: Invalid value: "not a url::": spec.storage.s3.endpointUrl in body should match'),
    ("output-is-the-input", with_spec(input={"uri": "s3://b/data"}, output={"uri": "s3://b/data/"}),
     'spec.output.uri: Invalid value: spec.output.uri must not be spec.input.uri, lie inside it'),
    ("output-inside-the-input", with_spec(input={"uri": "file:///data/"}, output={"uri": "file:///data/runs/a"}),
     'spec.output.uri: Invalid value: spec.output.uri must not be spec.input.uri, lie inside it'),
    ("input-inside-the-output", with_spec(input={"uri": "s3://b/out/in.jsonl"}, output={"uri": "s3://b/out"}),
     'spec.output.uri: Invalid value: spec.output.uri must not be spec.input.uri, lie inside it'),
    ("line-limit-below-a-kib", with_spec(input={"uri": "file:///in", "maxLineBytes": 10}),
     "spec.input.maxLineBytes: Invalid value: 10: spec.input.maxLineBytes in body should be greater than or equal"),
    ("parallelism-beyond-int64", with_spec(workers={"parallelism": 10 ** 30}),
     'spec.workers.parallelism: Invalid value: "number": spec.workers.parallelism in body must be of type integer'),
    ("shard-bytes-beyond-int64", with_spec(sharding={"targetShardBytes": 2 ** 64}),
     'spec.sharding.targetShardBytes: Invalid value: "float64": spec.sharding.targetShardBytes in body must be of '
     "type int64"),
    ("shard-bytes-beyond-a-tib", with_spec(sharding={"targetShardBytes": 2 ** 41}),
     "spec.sharding.targetShardBytes: Invalid value: 2199023255552: spec.sharding.targetShardBytes in body should "
     "be less than or equal to 1099511627776"),
    ("publish-buckets-below-a-thousand-ids", with_spec(output={"uri": "file:///out", "publishBucketRows": 10}),
     "spec.output.publishBucketRows: Invalid value: 10: spec.output.publishBucketRows in body should be greater "
     "than or equal to 1000"),
    ("no-output", {**minimal(), "spec": {"input": {"uri": "file:///in"}}}, "spec.output: Required value"),
    ("zero-parallelism", with_spec(workers={"parallelism": 0}),
     "spec.workers.parallelism: Invalid value: 0: "
     "spec.workers.parallelism in body should be greater than or equal to 1"),
    ("too-many-gpus", with_spec(workers={"gpus": 65}),
     "spec.workers.gpus: Invalid value: 65: spec.workers.gpus in body should be less than or equal to 64"),
    ("vllm-without-gpus", with_spec(model={"engine": "vllm", "name": "m"}, workers={"gpus": 0}),
     'spec.workers.gpus: Invalid value: workers.gpus must be at least model.vllm.tensorParallelSize '
     "x model.vllm.pipelineParallelSize with model.engine vllm"),
    ("vllm-fewer-gpus-than-it-spans", with_spec(model={"engine": "vllm", "name": "m",
                                                       "vllm": {"tensorParallelSize": 2, "pipelineParallelSize": 2}},
                                                workers={"gpus": 2}),
     'spec.workers.gpus: Invalid value: workers.gpus must be at least'),
    ("parquet-from-openai-lines", with_spec(input={"uri": "file:///in", "format": "openai"},
                                            output={"uri": "file:///out", "format": "parquet"}),
     'spec.output.format: Invalid value: output.format parquet needs input.format jsonl or parquet'),
    ("price-as-words", with_spec(workers={"pricePerHour": "two dollars"}),
     'spec.workers.pricePerHour: Invalid value: "string": spec.workers.pricePerHour in body must be of type number'),
    ("negative-price", with_spec(workers={"pricePerHour": -1}),
     "spec.workers.pricePerHour: Invalid value: -1: spec.workers.pricePerHour in body should be greater than or "
     "equal to 0"),
    ("parallelism-as-words", with_spec(workers={"parallelism": "four"}),
     'spec.workers.parallelism: Invalid value: "string": spec.workers.parallelism in body must be of type integer'),
    ("cpu-not-a-quantity", with_spec(workers={"cpu": "lots"}),
     'spec.workers.cpu: Invalid value: "lots": spec.workers.cpu in body should match'),
    ("max-failed-indexes-beyond-kubernetes-cap", with_spec(workers={"maxFailedIndexes": 100001}),
     "spec.workers.maxFailedIndexes: Invalid value: 100001: "),
    ("toleration-exists-with-value", with_spec(workers={"tolerations": [{"key": "a", "operator": "Exists",
                                                                         "value": "b"}]}),
     'spec.workers.tolerations[0]: Invalid value: a toleration with operator Exists must not have a value'),
    ("toleration-without-key", with_spec(workers={"tolerations": [{"operator": "Equal", "value": "b"}]}),
     'spec.workers.tolerations[0]: Invalid value: a toleration without a key must use operator Exists'),
    ("toleration-seconds-without-noexecute", with_spec(workers={"tolerations": [
        {"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]}),
     'spec.workers.tolerations[0]: Invalid value: tolerationSeconds needs effect NoExecute'),
    ("temperature-too-high", with_spec(model={"temperature": 2.5}),
     "spec.model.temperature: Invalid value: 2.5: spec.model.temperature in body should be less than or equal to 2"),
    ("gpu-memory-utilization-zero", with_spec(model={"vllm": {"gpuMemoryUtilization": 0}}),
     "spec.model.vllm.gpuMemoryUtilization: Invalid value: 0: "
     "spec.model.vllm.gpuMemoryUtilization in body should be greater than 0"),
    ("zero-judge-rounds", with_spec(model={"task": "generate"},
                                   judge={"type": "regex", "pattern": "x", "maxRounds": 0}),
     "spec.judge.maxRounds: Invalid value: 0:"),
    ("misspelled-field", with_spec(workers={"gpu": 1}), 'unknown field "spec.workers.gpu"'),
    # What bij-api once made of completion_window "9999999d": past the last date a clock can hold.
    ("deadline-past-any-date", with_spec(deadlineSeconds=863999913600),
     "spec.deadlineSeconds: Invalid value: 863999913600: spec.deadlineSeconds in body should be less than or "
     "equal to 31622400"),
    ("pass-through-of-a-result-field", with_spec(input={"uri": "s3://b/in/", "passThrough": ["lang", "output"]}),
     'spec.input.passThrough[1]: Invalid value: "output": clashes with the result field of that name'),
    ("pass-through-twice", with_spec(input={"uri": "s3://b/in/", "passThrough": ["lang", "lang"]}),
     'spec.input.passThrough[1]: Duplicate value: "lang"'),
    ("pass-through-of-openai-lines", with_spec(input={"uri": "s3://b/in/", "format": "openai", "passThrough": []}),
     "spec.input.passThrough: Invalid value: input.passThrough needs input.format jsonl or parquet"),
    ("partition-by-input-with-judge-rounds", with_spec(
        output={"uri": "s3://bucket/out", "partitionBy": "input"}, model={"task": "generate"},
        judge={"type": "regex", "pattern": "x"}),
     "spec.output.partitionBy: Invalid value: output.partitionBy input needs judge.strategy inPlace"),
    ("name-too-long", {**minimal(), "metadata": {"name": "a" * 53}},
     '<nil>: Invalid value: metadata.name must be at most 52 characters'),
    ("name-with-dots", {**minimal(), "metadata": {"name": "my.job"}},
     '<nil>: Invalid value: metadata.name must be lowercase letters'),
]


@pytest.mark.parametrize("doc, expected", [(d, e) for _, d, e in BAD], ids=[i for i, _, _ in BAD])
def test_bad_spec_is_rejected_by_the_crd_and_the_model(doc: dict[str, Any], expected: str) -> None:
    verdicts = validate.check_document(doc)
    assert any(p.startswith(expected) for p in verdicts.schema), verdicts.schema
    assert verdicts.model, "the CRD rejects this but the BatchInferenceJob model accepts it"
    assert validate.validate_document(doc) == verdicts.schema


GOOD = [
    ("llm-judge", with_spec(model={"task": "chat"}, judge={"type": "llm", "prompt": "Grade: {output}"})),
    ("jsonschema-judge", with_spec(model={"task": "generate"}, judge={"type": "jsonSchema", "schema": {}})),
    ("tolerate-everything", with_spec(workers={"tolerations": [{"operator": "Exists"}]})),
    ("toleration-seconds", with_spec(workers={"tolerations": [
        {"key": "a", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}]})),
    ("hostpath-cache", with_spec(workers={"modelCache": {"type": "hostPath", "path": "/mnt/models"}})),
    ("pvc-cache", with_spec(workers={"modelCache": {"type": "pvc", "claimName": "models"}})),
    ("quantities", with_spec(workers={"cpu": "500m", "memory": "1.5Gi", "shmSize": "1e9"})),
    ("longest-name", {**minimal(), "metadata": {"name": "a" * 52}}),
    ("longest-deadline", with_spec(deadlineSeconds=366 * 86400)),
    ("parquet-in-and-out", with_spec(input={"uri": "s3://b/in/", "format": "parquet", "textField": "body"},
                                     output={"uri": "s3://b/out/", "format": "parquet"})),
    ("vllm-default-gpus", with_spec(model={"engine": "vllm", "name": "m", "vllm": {"tensorParallelSize": 2}})),
    ("vllm-more-gpus", with_spec(model={"engine": "vllm", "name": "m"}, workers={"gpus": 4})),
    ("transformers-chat", with_spec(model={"engine": "transformers", "task": "chat", "name": "gpt2"})),
    ("sibling-folders", with_spec(input={"uri": "s3://b/in"}, output={"uri": "s3://b/in-runs/"})),
    ("relative-file-path", with_spec(input={"uri": "file://data/in.jsonl"}, output={"uri": "file://out/"})),
    ("endpoint-with-port-and-path", with_spec(storage={"s3": {"endpointUrl": "http://minio.local:9000/s3"}})),
    ("pass-through-narrowed", with_spec(input={"uri": "s3://b/in/", "format": "parquet",
                                               "passThrough": ["text", "lang"]})),
    ("pass-through-off", with_spec(input={"uri": "s3://b/in/", "passThrough": []})),
    ("partition-by-input-judged-in-place", with_spec(
        output={"uri": "s3://bucket/out", "partitionBy": "input"}, model={"task": "generate"},
        judge={"type": "regex", "pattern": "x", "strategy": "inPlace"})),
]


@pytest.mark.parametrize("doc", [d for _, d in GOOD], ids=[i for i, _ in GOOD])
def test_edge_of_valid_is_accepted_by_the_crd_and_the_model(doc: dict[str, Any]) -> None:
    verdicts = validate.check_document(doc)
    assert verdicts.schema == [] and verdicts.model == [] and verdicts.model_stored == []


def test_type_errors_stop_the_cel_rules_like_the_api_server() -> None:
    doc = with_spec(workers={"gpus": "one", "modelCache": {"type": "pvc"}})
    problems = validate.check_document(doc).schema
    assert problems[-1] == validate.RULES_SKIPPED
    assert not any("claimName" in p for p in problems)


def test_wrong_kind_is_not_validated_further() -> None:
    doc = {**minimal(), "apiVersion": "batchinference.io/v1"}
    problems = validate.validate_document(doc)
    assert len(problems) == 1
    assert 'no matches for kind "BatchInferenceJob" in version "batchinference.io/v1"' in problems[0]


def test_regex_the_crd_cannot_check_is_still_reported() -> None:
    # CEL cannot tell whether a string is a valid regular expression; the model can.
    doc = with_spec(model={"task": "generate"}, judge={"type": "regex", "pattern": "("})
    verdicts = validate.check_document(doc)
    assert verdicts.schema == []
    (problem,) = validate.validate_document(doc)
    assert problem.startswith("spec.judge: judge.pattern is not a valid regular expression")
    assert problem.endswith("(the CRD accepts this, the BatchInferenceJob model does not)")


def test_status_in_a_create_request_is_ignored() -> None:
    doc = {**minimal(), "status": {"phase": 7, "anything": True}}
    assert validate.validate_document(doc) == []


# --- the CLI ------------------------------------------------------------------------------


def test_cli_validate_says_valid(capsys: pytest.CaptureFixture[str]) -> None:
    assert bij_main(["validate", str(ROOT / "examples" / "judge-rounds.yaml")]) == 0
    assert capsys.readouterr().out == "valid\n"


def test_cli_validate_lists_every_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = with_spec(workers={"parallelism": 0, "modelCache": {"type": "pvc"}})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert bij_main(["validate", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f'{path}: BatchInferenceJob "job" is invalid:'
    assert out[1].startswith("  * spec.workers.parallelism: Invalid value: 0:")
    assert out[2].startswith('  * spec.workers.modelCache: Invalid value: modelCache.type pvc needs')


def test_cli_validate_fails_on_a_file_without_a_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}))
    assert bij_main(["validate", str(path)]) == 1
    assert "no BatchInferenceJob document" in capsys.readouterr().out
