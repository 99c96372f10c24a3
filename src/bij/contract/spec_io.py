"""The spec's places: where the rows come from (spec.input), where the results go (spec.output), the storage
endpoint and credentials (spec.storage), and the URI rules they share, made from contract.schemes' rows.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from bij.contract.columns import RESULT_FIELDS, consumed
from bij.contract.formats import OutputFormat
from bij.contract.globs import check_glob, has_glob
from bij.contract.schema import INT64, cel, k8s
from bij.contract.schemes import SCHEMES, WRITABLE, forms, prefixes, scheme_of, uri_pattern
from bij.contract.spec_base import SpecModel

# A longer input line is an error row (its bytes are never held in memory).
DEFAULT_MAX_LINE_BYTES = 32 << 20
# One image of a chat row at most (OpenAI's own limit per image).
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
# Ids one publish dedupe process holds at once, by default (spec.output.publishBucketRows), and the
# least a spec may ask for (fewer means more bucket files: shards x buckets).
PUBLISH_BUCKET_ROWS = 250_000
MIN_PUBLISH_BUCKET_ROWS = 1000

# The CRD's rule on InputSpec says the same.
PASS_THROUGH_NOT_OPENAI = (
    "input.passThrough needs input.format jsonl or parquet: an OpenAI batch output line has a fixed shape "
    "(custom_id, response, error) and carries no input columns"
)

# An S3 endpoint: scheme, host, optional port and path (botocore refuses anything else).
ENDPOINT_PATTERN = r"^https?://[^\s/?#:]+(:[0-9]{1,5})?(/[^\s]*)?$"
# A URI of a writable scheme (s3://bucket[/key], file:// with a path, ...) or of any scheme an input may
# name: made from contract.schemes' rows, as the CRD's rules are.
URI_PATTERN = uri_pattern(writable_only=True)
INPUT_PATTERN = uri_pattern()
HTTP_PATTERN = "^(" + "|".join(s.pattern for s in SCHEMES if s.prefix.startswith("http")) + ")$"
HF_PATTERN = "^(" + "|".join(s.pattern for s in SCHEMES if s.prefix == "hf://") + ")$"
# What the API server checks of a URI (CEL's matches(): RE2, a pattern inside a single-quoted string).
MAX_URI = 4096


def _matches(pattern: str) -> str:
    return "self.matches('" + pattern.replace("\\", "\\\\") + "')"


INPUT_URI_RULE = cel(_matches(INPUT_PATTERN), f"must start with {prefixes()}, as {forms()}")
STORE_URI_RULE = _matches(URI_PATTERN)
STORE_URI_MESSAGE = f"must start with {prefixes(writable_only=True)}, as {forms(writable_only=True)}"


class S3Options(SpecModel):
    endpoint_url: str | None = Field(None, json_schema_extra=k8s(pattern=ENDPOINT_PATTERN))
    """S3-compatible endpoint (MinIO, R2, GCS interop); default AWS"""
    region: str | None = None
    """the S3 region; default from the pods' environment"""

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, url: str | None) -> str | None:
        if url is not None and not re.match(ENDPOINT_PATTERN, url):
            raise ValueError(f"must be an http(s) URL such as https://s3.example.com:9000, got {url!r}")
        return url


class StorageSpec(SpecModel):
    s3: S3Options = S3Options()
    """the S3 endpoint and region (also for gs:// through Google's S3-compatible API)"""
    credentials_secret: str | None = None
    """Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, passed to workers with envFrom; without it the pods'
    identity (IRSA, workload identity) is used"""

PASS_THROUGH_CLASH = cel(
    "!(self in [" + ", ".join(f"'{name}'" for name in sorted(RESULT_FIELDS)) + "])",
    "clashes with the result field of that name: result rows carry " + ", ".join(sorted(RESULT_FIELDS)))
# A passThrough column: the API server checks its length and name (InputSpec._pass_through does in Python).
ColumnName = Annotated[str, Field(json_schema_extra=k8s(PASS_THROUGH_CLASH, minLength=1, maxLength=256))]


class InputSpec(SpecModel):
    model_config = ConfigDict(json_schema_extra=k8s(
        cel("!has(self.passThrough) || !has(self.format) || self.format != 'openai'", PASS_THROUGH_NOT_OPENAI,
            ".passThrough")))

    uri: str = Field(json_schema_extra=k8s(INPUT_URI_RULE, maxLength=MAX_URI))
    """file:///path, s3://bucket/prefix, gs://bucket/prefix (Google Cloud Storage) or az://container/prefix (Azure
    Blob Storage), or a glob below a folder:
    s3://bucket/logs/2026-*/part-*.jsonl, file:///data/**/*.jsonl (* and ? within a name, [abc], ** any folders),
    or one object at an https:// URL (a presigned or signed URL too), or files of a Hugging Face Hub dataset:
    hf://datasets/OWNER/NAME[@REVISION]/PATH"""
    format: Literal["jsonl", "openai", "parquet"] = "jsonl"
    """jsonl (one object per line), openai (OpenAI batch request lines) or parquet (*.parquet objects; idField,
    textField and messagesField name columns)"""
    id_field: str = "id"
    """field (JSONL) or column (Parquet) holding a row's id, carried to its result"""
    text_field: str = "text"
    """field (JSONL) or column (Parquet) holding a row's text: the prompt, or the text to embed"""
    messages_field: str | None = None
    """field holding a chat messages list (task chat); default wraps textField as one user message"""
    sampling_field: str = "sampling"
    """field (JSONL) or struct column (Parquet) holding a row's own sampling fields, with model.sampling's keys;
    they win over the spec's. Unknown keys are invalid_request error rows, fields the engine cannot honour
    unsupported error rows"""
    adapter_field: str = "adapter"
    """field (JSONL) or column (Parquet) naming a row's LoRA adapter from model.adapters"""
    pair_field: str = "pair"
    """task score: field (JSONL) or column (Parquet) holding the text scored against textField's"""
    query_field: str = "query"
    """task rerank: field (JSONL) or column (Parquet) holding the query"""
    documents_field: str = "documents"
    """task rerank: field (JSONL) or column (Parquet) holding the list of texts ranked against the query"""
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1024, le=1 << 31, json_schema_extra=INT64)
    """a longer input line is an error row (its bytes are never held in memory)"""
    max_image_bytes: int = Field(DEFAULT_MAX_IMAGE_BYTES, ge=1, le=1 << 31, json_schema_extra=INT64)
    """one image of a chat row (an image_url part: a data URL, file:// or s3://) at most; a larger one is an
    image_too_large error row"""
    image_root: str | None = Field(None, json_schema_extra=k8s(
        cel("self.matches('^file:///.+$')", "must be a file:// folder, as file:///path"), maxLength=MAX_URI))
    """the file:// folder file:// images may be read from (regular files only, never /proc, /sys, /dev, /etc or a
    service-account token); default the folder of a file:// input, none for an s3:// input"""
    on_damaged_object: Literal["fail", "errorRow"] = "fail"
    """a .zst object cut short or damaged: fail the round naming the object and the byte offset, the rows before it
    kept (a rerun after replacing the object resumes); or errorRow: one corrupt_input error row where it breaks,
    the rest of the object unread"""
    pass_through: list[ColumnName] | None = Field(None, max_length=1000,
                                                  json_schema_extra=k8s(x_kubernetes_list_type="set"))
    """input columns carried to each result (and error) row beside its result fields: unset, every column the
    request does not consume (not the id, text, messages, sampling or adapter columns); a list, those columns
    only; [] none. A column named like a result field is refused at plan time (unset) or here (listed). JSONL and
    Parquet input only"""

    @field_validator("pass_through")
    @classmethod
    def _pass_through(cls, names: list[str] | None) -> list[str] | None:
        if names is None:
            return None
        for name in names:
            if not name or len(name) > 256:
                raise ValueError(f"column names have 1 to 256 characters, got {name[:40]!r}")
            if name in RESULT_FIELDS:
                raise ValueError(f"column {name!r} clashes with the result field of that name; result rows carry "
                                 f"{', '.join(sorted(RESULT_FIELDS))}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"column {dup[0]!r} is named twice")
        return names

    @model_validator(mode="after")
    def _pass_through_format(self) -> InputSpec:
        if self.pass_through is not None and self.format == "openai":
            raise ValueError(PASS_THROUGH_NOT_OPENAI)
        return self

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        if uri.startswith(("https://", "http://")):
            # One object read with range requests (storage_http): HTTP lists nothing.
            if not re.match(HTTP_PATTERN, uri):
                raise ValueError(f"an http(s) input names one object: https://host/path, got {uri!r}")
            if has_glob(uri.split("?", 1)[0]):
                raise ValueError(f"an http(s) input names one object: no wildcards, got {uri!r}")
            return uri
        check_glob(uri)  # a glob below the folder it names: contract.globs
        if uri.startswith("hf://"):
            if not re.match(HF_PATTERN, uri):
                raise ValueError(f"an hf:// input is a dataset: hf://datasets/OWNER/NAME[@REVISION]/PATH, got {uri!r}")
            return uri
        return check_uri(uri)

    @field_validator("image_root")
    @classmethod
    def _image_root(cls, uri: str | None) -> str | None:
        if uri is not None and not (uri.startswith("file:///") and len(uri) > len("file:///")):
            raise ValueError("must be a file:// folder, as file:///path")
        return uri

    def consumed_columns(self) -> frozenset[str]:
        """The columns a row's request consumes (contract.columns): never carried unless passThrough names them."""
        return consumed(self.id_field, self.text_field, self.messages_field, self.sampling_field, self.adapter_field)

    def carries_every_column(self) -> bool:
        """Whether rows carry every column their request does not consume (passThrough unset, plain input)."""
        return self.pass_through is None and self.format != "openai"

    def image_root_path(self) -> str | None:
        """The folder (a path) file:// images may come from, or None."""
        if self.image_root is not None:
            return self.image_root.removeprefix("file://")
        if self.uri.startswith("file://"):
            path = self.uri.removeprefix("file://")
            return path if path.endswith("/") else posixpath.dirname(path) or "/"
        return None


class OutputSpec(SpecModel):
    uri: str = Field(json_schema_extra=k8s(
        cel(STORE_URI_RULE, STORE_URI_MESSAGE),
        cel("!self.matches('[*?\\\\[]')", "an output is one folder: no wildcards (* ? [)"), maxLength=MAX_URI))
    """file:///path, s3://bucket/prefix, gs://bucket/prefix or az://container/prefix; manifest.json is written
    here last"""
    format: OutputFormat = "jsonl"
    """result files as JSON lines, Parquet or CSV (error and capped files stay JSON lines)"""
    compression: Literal["zstd", "none"] = "zstd"
    """compression of the result files: zstd or none"""
    keep_intermediate: bool = False
    """keep the work files under _bij/ (durable logs, judge inputs) after a successful publish; when false they are
    removed and the job cannot be published again"""
    publish_bucket_rows: int = Field(PUBLISH_BUCKET_ROWS, ge=MIN_PUBLISH_BUCKET_ROWS, json_schema_extra=INT64)
    """ids one publish dedupe process holds at once (its memory); fewer ids a bucket means more bucket files (shards
    x buckets)"""
    partition_by: Literal["shard", "input"] = "shard"
    """shard: result files results/r<round>-<shard>[-<part>]; input: one result file per input object under results/
    with the input's name relative to the input folder or glob root (and the result format's extension), errors/
    and capped/ alike. With input, no object is cut across shards (parallelism is at most the input objects)"""

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, uri: str) -> str:
        if has_glob(uri):
            raise ValueError(f"an output is one folder: no wildcards (* ? [), got {uri!r}")
        return check_uri(uri)


def check_uri(uri: str) -> str:
    """`uri` if it is of a writable scheme and has that scheme's form; a ValueError saying why not."""
    if not uri.startswith(WRITABLE):
        raise ValueError(f"must start with {prefixes(writable_only=True)}, got {uri!r}")
    scheme = scheme_of(uri)
    if scheme is not None and not re.match(f"^({scheme.pattern})$", uri):
        raise ValueError(f"{scheme.prefix} needs {scheme.needs} ({scheme.form}), got {uri!r}")
    return uri


def folder_key(uri: str) -> str:
    """A URI as a folder, for comparing places: one trailing slash, `.`/`..` resolved in file:// paths."""
    if uri.startswith("file://"):
        path = posixpath.normpath(uri[len("file://"):])
        uri = "file://" + path
    return uri.rstrip("/") + "/"


def uris_overlap(a: str, b: str) -> bool:
    """Whether one URI is the other or lies under it (`in/` and `in-old/` do not overlap)."""
    fa, fb = folder_key(a), folder_key(b)
    return fa.startswith(fb) or fb.startswith(fa)
