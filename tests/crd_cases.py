"""BatchInferenceJobs the CRD must refuse, with the API server's message for each: checked offline by
`bij validate` (tests/contract/test_crd.py) and against a real kube-apiserver (tests/system/test_cluster.py)."""

from __future__ import annotations

import copy
from typing import Any


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
    ("judge-on-a-classifier", with_spec(model={"engine": "transformers", "name": "m", "task": "classify"},
                                        judge={"type": "regex", "pattern": "x"}),
     "spec.judge: Invalid value: judge needs a generate or chat task: embeddings and pooling tasks have no text"),
    ("judge-without-type", with_spec(model={"task": "generate"}, judge={"pattern": "x"}),
     "spec.judge.type: Required value"),
    ("sentence-transformers-generating", with_spec(model={"engine": "sentence-transformers", "task": "generate"}),
     "spec.model: Invalid value: engine sentence-transformers supports tasks embed, classify, score and rerank"),
    ("transformers-embedding", with_spec(model={"engine": "transformers", "task": "embed"}),
     "spec.model: Invalid value: engine transformers supports tasks generate, chat, classify, score and rerank"),
    ("a-classifier-without-a-model", with_spec(model={"engine": "sentence-transformers", "task": "rerank"}),
     "spec.model: Invalid value: model.task classify, score and rerank need model.name"),
    ("echo-reranking", with_spec(model={"task": "rerank"}),
     "spec.model: Invalid value: engine echo supports tasks embed, generate and chat"),
    ("simulated-scoring", with_spec(model={"engine": "simulated", "task": "score", "name": "m"}),
     "spec.model: Invalid value: engine simulated supports tasks embed, generate and chat"),
    ("http-without-a-url", with_spec(model={"engine": "http", "task": "chat", "name": "m"}),
     "spec.model: Invalid value: model.engine http needs model.http.baseUrl"),
    ("unknown-engine", with_spec(model={"engine": "tgi"}),
     'spec.model.engine: Unsupported value: "tgi": supported values: "echo", "sentence-transformers"'),
    ("hostpath-cache-without-path", with_spec(workers={"modelCache": {"type": "hostPath"}}),
     'spec.workers.modelCache: Invalid value: modelCache.type hostPath needs modelCache.path'),
    ("pvc-cache-without-claim", with_spec(workers={"modelCache": {"type": "pvc", "claimName": ""}}),
     'spec.workers.modelCache: Invalid value: modelCache.type pvc needs modelCache.claimName'),
    ("ftp-input", with_spec(input={"uri": "ftp://example.com/in.jsonl"}),
     'spec.input.uri: Invalid value: "ftp://example.com/in.jsonl": '
     'must start with file://, s3://, gs://, az://, https://, http:// or hf://'),
    ("https-input-without-an-object", with_spec(input={"uri": "https://example.com/data/"}),
     'spec.input.uri: Invalid value: "https://example.com/data/": '
     'must start with file://, s3://, gs://, az://, https://, http:// or hf://'),
    ("https-output", with_spec(output={"uri": "https://example.com/out/r.jsonl"}),
     'spec.output.uri: Invalid value: "https://example.com/out/r.jsonl": must start with file://, s3://, gs:// or az://'),
    ("vllm-with-a-batch-shape", with_spec(model={"engine": "vllm", "name": "m", "task": "generate"},
                                          batching={"maxBatchSize": 64}),
     "spec.batching: Invalid value: batching.targetBatchTokens and batching.maxBatchSize shape"),
    ("output-with-a-glob", with_spec(output={"uri": "s3://b/out-*/"}),
     'spec.output.uri: Invalid value: "s3://b/out-*/": an output is one folder: no wildcards'),
    ("s3-output-without-bucket", with_spec(output={"uri": "s3://"}),
     'spec.output.uri: Invalid value: "s3://": must start with file://, s3://, gs:// or az://'),
    ("s3-input-with-an-empty-bucket", with_spec(input={"uri": "s3:///"}),
     'spec.input.uri: Invalid value: "s3:///": '
     'must start with file://, s3://, gs://, az://, https://, http:// or hf://, as file:///absolute/path or '
     'file://relative/path (a path), s3://bucket/prefix (a bucket), gs://bucket/prefix (a bucket), '
     'az://container/prefix (a container)'),
    ("gs-output-without-bucket", with_spec(output={"uri": "gs:///out/"}),
     'spec.output.uri: Invalid value: "gs:///out/": must start with file://, s3://, gs:// or az://, as '
     'file:///absolute/path or file://relative/path (a path), s3://bucket/prefix (a bucket), '
     'gs://bucket/prefix (a bucket), az://container/prefix (a container)'),
    ("file-output-without-path", with_spec(output={"uri": "file://"}),
     'spec.output.uri: Invalid value: "file://": must start with file://, s3://, gs:// or az://'),
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
     'spec.output.format: Invalid value: output.format other than jsonl needs input.format jsonl or parquet'),
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
    ("prompt-over-openai-lines", with_spec(input={"uri": "s3://b/in/", "format": "openai"},
                                           prompt={"template": "{{ row.title }}"}),
     "spec.prompt: Invalid value: prompt needs input.format jsonl or parquet"),
    ("prompt-beside-messages", with_spec(input={"uri": "s3://b/in/", "messagesField": "messages"},
                                         model={"task": "chat"}, prompt={"template": "{{ row.title }}"}),
     "spec.prompt: Invalid value: prompt renders each row's user message from its columns"),
    ("prompt-system-without-chat", with_spec(model={"task": "generate"},
                                             prompt={"system": "Be terse.", "template": "{{ row.title }}"}),
     "spec.prompt.system: Invalid value: prompt.system is a chat system message and needs model.task chat"),
    ("prompt-without-template", with_spec(prompt={"system": "Be terse."}), "spec.prompt.template: Required value"),
    ("notify-over-ftp", with_spec(notify=[{"url": "ftp://hooks.example.com/bij",
                                           "secretRef": {"name": "h", "key": "k"}}]),
     'spec.notify[0].url: Invalid value: "ftp://hooks.example.com/bij": spec.notify[0].url in body should match'),
    ("notify-with-credentials-in-the-url", with_spec(notify=[{"url": "https://me:pw@hooks.example.com/bij",
                                                             "secretRef": {"name": "h", "key": "k"}}]),
     'spec.notify[0].url: Invalid value: "https://me:pw@hooks.example.com/bij": spec.notify[0].url in body '
     'should match'),
    ("notify-unknown-event", with_spec(notify=[{"url": "https://hooks.example.com/bij", "events": ["completed"],
                                                "secretRef": {"name": "h", "key": "k"}}]),
     'spec.notify[0].events[0]: Unsupported value: "completed": supported values: "succeeded", "failed"'),
    ("notify-event-twice", with_spec(notify=[{"url": "https://hooks.example.com/bij", "events": ["failed", "failed"],
                                              "secretRef": {"name": "h", "key": "k"}}]),
     'spec.notify[0].events[1]: Duplicate value: "failed"'),
    ("notify-unsigned", with_spec(notify=[{"url": "https://hooks.example.com/bij"}]),
     "spec.notify[0].secretRef: Required value"),
]
