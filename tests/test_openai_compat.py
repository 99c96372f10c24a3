"""OpenAI batch output lines parse with the `openai` SDK's own response models.

Code that already reads OpenAI Batch API results reads ours: every body (chat completion,
completion, embedding) and every error line validates against the SDK, so the format cannot
drift from what clients read.
"""

from __future__ import annotations

from typing import Any

import pytest
from bij_operator.publish import publish

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def request(cid: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}


CASES = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]},
             chat_types.ChatCompletion),
    "generate": ("/v1/completions", {"prompt": "once upon a time"}, openai_types.Completion),
    "embed": ("/v1/embeddings", {"input": "a sentence to embed"}, openai_types.CreateEmbeddingResponse),
}


@pytest.mark.parametrize("task", sorted(CASES))
def test_result_bodies_and_error_lines_validate_against_the_openai_sdk(
        task: str, file_place, make_job, run_shards, read_output) -> None:
    url, body, model = CASES[task]
    lines = [request("ok-1", url, body), request("bad-1", url, {"max_tokens": 0, **body}),
             request("ok-2", url, body), "not json", request("ok-1", url, body)]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": task})
    run_shards(job)
    publish(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == ["ok-1", "ok-2"]
    for line in out.results:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        parsed = model.model_validate(line["response"]["body"])
        if task == "embed":
            assert len(parsed.data[0].embedding) > 0 and parsed.usage.prompt_tokens > 0
        else:
            assert parsed.created > 0 and parsed.choices[0].finish_reason in ("stop", "length")
            assert parsed.usage is not None and parsed.usage.total_tokens > 0
    # The second ok-1 is a duplicate_id line, in the same shape as every other error line.
    assert [(e["custom_id"], e["error"]["code"]) for e in out.errors] == [
        ("bad-1", "invalid_request"), (None, "invalid_json"), ("ok-1", "duplicate_id")]
    for line in out.errors:
        assert line["response"] is None
        err = openai_types.BatchError.model_validate(line["error"])
        assert err.code and err.message
