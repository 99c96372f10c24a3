"""Images of chat rows (images.py, inputs.py): data URLs, file:// and s3:// images, their limit,
the schemes refused, and engines without vision refusing image rows instead of answering the text.

The vLLM tier (test_vllm.py) runs image rows through a vision model on the real engine.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from bij.contract.sampling import IMAGES
from bij.engines.base import BASIC_SAMPLING, EngineBase, Image
from bij.storage import open_storage
from bij.worker.images import ImageProblem, fetch_images
from bij.worker.input_row import InputOptions
from bij.worker.inputs import parse_line

VISION = InputOptions(format="openai", task="chat", engine="vllm", honours=BASIC_SAMPLING | {IMAGES},
                      max_image_bytes=64)
TEXT_ONLY = InputOptions(format="openai", task="chat", engine="transformers", honours=BASIC_SAMPLING)


def parse(obj: Any, opts: InputOptions) -> Any:
    line = json.dumps(obj).encode()
    return parse_line(line, (0, 0, len(line)), "in.jsonl", opts)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def part(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def line(*parts: dict[str, Any], cid: str = "r1") -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": content}]}}


def test_images_reach_the_request_in_the_order_of_their_parts() -> None:
    row = parse(line(part(data_url(b"first")), part("file:///pics/b.png"), part("s3://bucket/c.jpg", detail="auto"),
                     part("gs://bucket/d.webp")), VISION)
    assert row.error is None
    assert row.request.images == (Image("data:image/png;base64", b"first"), Image("file:///pics/b.png"),
                                  Image("s3://bucket/c.jpg"), Image("gs://bucket/d.webp"))


def test_an_image_row_on_an_engine_without_vision_is_unsupported_never_the_text_alone() -> None:
    row = parse(line(part(data_url(b"x"))), TEXT_ONLY)
    assert (row.request, row.error_code) == (None, "unsupported")
    assert row.error == "engine transformers cannot honour an image_url content part"
    plain = InputOptions(task="chat", messages_field="messages", engine="echo", honours=BASIC_SAMPLING)
    row = parse({"id": 1, "messages": line(part("file:///a.png"))["body"]["messages"]}, plain)
    assert (row.request, row.error) == (None, "engine echo cannot honour an image_url content part")


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://10.0.0.1/x.jpg", "wasbs://bucket/x.png",
                                 "ftp://x/y.png", "cat.png", "file://"])
def test_other_schemes_are_refused_with_the_reason(url: str) -> None:
    row = parse(line(part(url)), VISION)
    assert row.error_code == "unsupported"
    assert row.error.startswith("body.messages[0].content[1].image_url.url: ")
    assert "images are not fetched (data: URLs, file://, s3://, gs:// and az:// are" in row.error


def test_a_data_url_over_max_image_bytes_is_image_too_large_and_one_at_the_limit_is_taken() -> None:
    assert parse(line(part(data_url(b"x" * 64))), VISION).request.images[0].data == b"x" * 64
    for size in (65, 66, 67, 1000):  # every base64 padding
        row = parse(line(part(data_url(b"x" * size))), VISION)
        assert row.error_code == "image_too_large", size
        assert f"the image is {size} bytes, over input.maxImageBytes (64)" in row.error


@pytest.mark.parametrize(("image_url", "code", "needle"), [
    ({"url": "data:image/png;base64,@@@@"}, "invalid_request", "not valid base64"),
    ({"url": "data:text/plain;base64,aGk="}, "invalid_request", "must be data:image/<type>;base64,<data>"),
    ({"url": "data:image/png,rawbytes"}, "invalid_request", "must be data:image/<type>;base64,<data>"),
    ({"url": 7}, "invalid_request", "image_url must be an object with a string url"),
    ({"url": "file:///a.png", "size": 3}, "invalid_request", "unknown field 'size'"),
    ({"url": "file:///a.png", "detail": "huge"}, "invalid_request", "detail must be one of auto, low, high"),
    ({"url": "file:///a.png", "detail": "low"}, "unsupported", "detail 'low' is not honoured"),
])
def test_bad_image_parts_name_the_problem_and_the_part(image_url: dict[str, Any], code: str, needle: str) -> None:
    row = parse(line({"type": "image_url", "image_url": image_url}), VISION)
    assert row.error_code == code and needle in row.error, row.error
    assert "body.messages[0].content[1]" in row.error


def test_file_images_are_read_within_the_limit(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(b"p" * 64)
    (tmp_path / "big.png").write_bytes(b"p" * 65)
    store = open_storage(f"file://{tmp_path}/", None)
    got = fetch_images((Image("data:image/png;base64", b"d"), Image(f"file://{tmp_path}/ok.png")),
                       lambda uri: store, 64, str(tmp_path))
    assert got == (Image("data:image/png;base64", b"d"), Image(f"file://{tmp_path}/ok.png", b"p" * 64))
    with pytest.raises(ImageProblem) as e:
        fetch_images((Image(f"file://{tmp_path}/big.png"),), lambda uri: store, 64, str(tmp_path))
    assert e.value.code == "image_too_large" and "big.png is over input.maxImageBytes (64)" in str(e.value)
    with pytest.raises(ImageProblem) as e:
        fetch_images((Image(f"file://{tmp_path}/gone.png"),), lambda uri: store, 64, str(tmp_path))
    assert e.value.code == "image_not_found" and "gone.png" in str(e.value)


def test_file_images_are_regular_files_under_the_image_root_and_never_system_files(tmp_path: Path) -> None:
    """A FIFO is refused at once (opened without blocking, fstat before any read), never waited on;
    /etc, /proc, /dev and a service-account token are refused before they are opened, a symbolic
    link is judged by what it points at, and nothing is read outside the root or without one."""
    import os
    import threading

    from bij.worker.images import read_local_image

    root = tmp_path / "pics"
    root.mkdir()
    (root / "ok.png").write_bytes(b"p" * 8)
    os.mkfifo(root / "pipe.png")
    (root / "sub").mkdir()
    os.symlink("/etc/passwd", root / "passwd.png")
    os.symlink(tmp_path / "outside.png", root / "out.png")
    (tmp_path / "outside.png").write_bytes(b"o")
    cases = {
        f"file://{root}/pipe.png": "not a regular file",
        f"file://{root}/sub": "not a regular file",
        "file:///etc/passwd": "never read from /etc",
        f"file://{root}/passwd.png": "never read from /etc",
        "file:///proc/self/environ": "never read from /proc",
        "file:///dev/zero": "never read from /dev",
        "file:///var/run/secrets/kubernetes.io/serviceaccount/token": "/run/secrets",  # /var/run is /run
        f"file://{root}/out.png": "outside input.imageRoot",
        f"file://{root}/../outside.png": "outside input.imageRoot",
    }
    done = threading.Event()

    def check() -> None:
        for uri, why in cases.items():
            with pytest.raises(ImageProblem) as e:
                read_local_image(uri, str(root), 64)
            assert e.value.code == "image_not_found" and why in str(e.value), (uri, str(e.value))
        done.set()

    t = threading.Thread(target=check, daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "a check hung (or failed: see the thread's exception above)"
    assert read_local_image(f"file://{root}/ok.png", str(root), 64) == b"p" * 8
    with pytest.raises(ImageProblem, match="read only under input.imageRoot"):
        read_local_image(f"file://{root}/ok.png", None, 64)
    with pytest.raises(ImageProblem) as e:
        read_local_image(f"file://{root}/ok.png", str(root), 4)
    assert e.value.code == "image_too_large"


def test_s3_images_are_read_through_the_jobs_storage(s3_place: Any) -> None:
    store = s3_place.storage
    store.write_bytes(s3_place.uri("pics/a.png"), b"s3 image")
    (got,) = fetch_images((Image(s3_place.uri("pics/a.png")),), lambda uri: store, 64)
    assert got.data == b"s3 image"
    with pytest.raises(ImageProblem) as e:
        fetch_images((Image(s3_place.uri("pics/none.png")),), lambda uri: store, 64)
    assert e.value.code == "image_not_found"


class ImageBytes(EngineBase):
    """A stand-in vision engine (the real one is vLLM's, in the vLLM tier): it declares images and
    answers each row with the sizes and first bytes of the images it was handed."""

    name, schedules_itself, continuous, parallel_prepare = "seer", False, False, False
    honours = BASIC_SAMPLING | {IMAGES}

    def load(self) -> None:
        pass

    def count_tokens(self, requests: list[Any]) -> list[int]:
        return [1] * len(requests)

    def max_input_tokens(self) -> None:
        return None

    def run(self, requests: list[Any]) -> list[Any]:
        from bij.engines.base import Result

        return [Result(output=" ".join(f"{len(im.data)}:{im.data[:1].decode()}" for im in r.images),
                       prompt_tokens=1, completion_tokens=1) for r in requests]


def test_a_job_fetches_each_rows_images_before_the_engine_sees_them(file_place, make_job, run_shards,
                                                                    read_output, tmp_path: Path) -> None:
    from bij.local.publish import publish_manifest

    (tmp_path / "a.png").write_bytes(b"a" * 10)
    (tmp_path / "big.png").write_bytes(b"b" * 65)
    lines = [line(part(f"file://{tmp_path}/a.png"), part(data_url(b"d" * 3)), cid="two"),
             line(part(f"file://{tmp_path}/big.png"), cid="big"),
             line(part(f"file://{tmp_path}/gone.png"), cid="gone"),
             line(part("https://x/y.png"), cid="web"),
             line(part(f"file://{tmp_path}/pipe.png"), cid="fifo"),
             line(part("file:///etc/passwd"), cid="passwd"),
             line(part(data_url(b"e" * 5)), cid="one")]
    os.mkfifo(tmp_path / "pipe.png")  # read with a plain open(), it would hang the worker
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai", "maxImageBytes": 64, "imageRoot": f"file://{tmp_path}"},
                      model={"task": "chat"})
    run_shards(job, ImageBytes())
    publish_manifest(job)
    out = read_output(job)
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in out.results}
    assert answers == {"two": "10:a 3:d", "one": "5:e"}
    errors = {e["custom_id"]: (e["error"]["code"], e["error"]["message"]) for e in out.errors}
    assert errors["big"] == ("image_too_large", f"image file://{tmp_path}/big.png is over input.maxImageBytes (64)")
    assert errors["gone"][0] == "image_not_found" and "gone.png" in errors["gone"][1]
    assert errors["web"][0] == "unsupported" and "https" in errors["web"][1]
    assert errors["fifo"] == ("image_not_found", f"image file://{tmp_path}/pipe.png: not a regular file")
    assert errors["passwd"] == ("image_not_found", "image file:///etc/passwd: images are never read from /etc")


def test_a_job_refuses_image_rows_on_an_engine_without_vision(file_place, make_job, run_shards,
                                                              read_output, tmp_path: Path) -> None:
    """On echo every image row is an unsupported error row, whatever its image; text rows are answered."""
    from bij.local.publish import publish_manifest

    (tmp_path / "pic.png").write_bytes(b"p" * 10)
    text = {"custom_id": "text", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hello"}]}}
    lines = [text, line(part(f"file://{tmp_path}/pic.png"), cid="file"), line(part(data_url(b"x")), cid="data")]
    _, job = make_job(file_place, file_place.write_jsonl("batch.jsonl", lines),
                      input={"format": "openai"}, model={"task": "chat"})
    run_shards(job)
    publish_manifest(job)
    out = read_output(job)
    assert [r["custom_id"] for r in out.results] == ["text"]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["message"]) for e in out.errors] == [
        ("file", "unsupported", "engine echo cannot honour an image_url content part"),
        ("data", "unsupported", "engine echo cannot honour an image_url content part")]
