"""The CRD (generated from the models: bij.contract.crd) and `bij validate`: the API server's verdict offline,
and the pydantic model agreeing with it."""

from __future__ import annotations

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
from crd_cases import BAD, minimal, with_spec

from bij.cli import validate
from bij.cli.main import main as bij_main
from bij.contract.spec import job_to_dict, parse_job

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "batchinferencejobs.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
KUBE_VERSIONS = ["1.34", "1.36"]  # bij's minimum (every Job feature used is GA), and the tested version


def load_sync_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sync_crd", ROOT / "tools" / "sync_crd.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


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
    assert list(columns) == ["Phase", "Round", "Shards", "Rows", "Age", "Lanes", "Pools", "Throughput", "ETA", "Cost",
                             "Output", "Message"]
    assert {n for n, c in columns.items() if c.get("priority") == 1} == {"Lanes", "Pools", "Throughput", "ETA", "Cost",
                                                                         "Output", "Message"}
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


def test_every_spec_field_is_described_for_kubectl_explain() -> None:
    """A field's docstring is its description: a new spec field without one fails here."""
    bare = [path for path, node in walk_schema(validate.crd_schema()["properties"]["spec"], "spec")
            if path != "spec" and not path.endswith(("[]", "{}")) and not node.get("description")]
    assert bare == []


def test_crd_files_are_what_the_models_generate() -> None:
    """crds/ and the chart's copy are `make sync-crd`'s output: a model changed without it fails here."""
    sync = load_sync_tool()
    assert sync.drifted(ROOT) == [], "run: make sync-crd"
    assert crd() == validate.load_crd()


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
    ("http-chat", with_spec(model={"engine": "http", "task": "chat", "name": "m",
                                   "http": {"baseUrl": "http://vllm.inference.svc:8000",
                                            "headersSecret": {"name": "fleet", "key": "token"}}})),
    ("transformers-chat", with_spec(model={"engine": "transformers", "task": "chat", "name": "gpt2"})),
    ("sibling-folders", with_spec(input={"uri": "s3://b/in"}, output={"uri": "s3://b/in-runs/"})),
    ("relative-file-path", with_spec(input={"uri": "file://data/in.jsonl"}, output={"uri": "file://out/"})),
    ("endpoint-with-port-and-path", with_spec(storage={"s3": {"endpointUrl": "http://minio.local:9000/s3"}})),
    ("pass-through-narrowed", with_spec(input={"uri": "s3://b/in/", "format": "parquet",
                                               "passThrough": ["text", "lang"]})),
    ("pass-through-off", with_spec(input={"uri": "s3://b/in/", "passThrough": []})),
    # model.maxTokens/temperature/seed carry no CRD default, so the API server's defaulting sets neither beside these.
    ("sampling-basics-alone", with_spec(model={"task": "generate",
                                               "sampling": {"temperature": 0.7, "maxTokens": 10, "seed": 3}})),
    ("prompt-chat-with-system", with_spec(model={"task": "chat"},
                                          prompt={"system": "Be terse.", "template": "{{ row.title }}"})),
    ("prompt-embed-prefix", with_spec(prompt={"template": "query: {{ row.text }}"})),
    ("notify-two-webhooks", with_spec(notify=[
        {"url": "https://hooks.example.com/bij?team=a", "secretRef": {"name": "hooks", "key": "hmac"}},
        {"url": "http://ops.monitoring.svc:8080/alerts", "secretRef": {"name": "ops", "key": "hmac"},
         "events": ["failed", "canaryFailed", "expired"]}])),
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


def test_cli_validate_says_which_webhooks_are_told_of_which_ends_and_where_the_key_comes_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = with_spec(notify=[{"url": "https://hooks.example.com/bij", "secretRef": {"name": "hooks", "key": "hmac"}},
                            {"url": "http://ops.svc:8080/a", "secretRef": {"name": "ops", "key": "k"},
                             "events": ["failed", "canaryFailed"]}])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert bij_main(["validate", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "valid",
        "notify: https://hooks.example.com/bij is told of succeeded, failed, cancelled, expired, canaryFailed (a POST "
        "signed with Secret hooks, key hmac; bij run: env BIJ_SECRET_HOOKS_HMAC)",
        "notify: http://ops.svc:8080/a is told of failed, canaryFailed (a POST signed with Secret ops, key k; bij run: "
        "env BIJ_SECRET_OPS_K); http:// sends the body unencrypted (it is signed, not secret)"]


def test_cli_validate_refuses_a_webhook_that_is_not_http_naming_it(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    doc = with_spec(notify=[{"url": "mailto:ops@example.com", "secretRef": {"name": "h", "key": "k"},
                             "events": ["done"]}])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert bij_main(["validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert 'spec.notify[0].url: Invalid value: "mailto:ops@example.com"' in out
    assert 'spec.notify[0].events[0]: Unsupported value: "done"' in out


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
