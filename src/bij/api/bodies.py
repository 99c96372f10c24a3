"""What each request may send, as pydantic models: a JSON body, the upload's form fields, a list's
query. `parse` makes a model of what came, or a 400 naming the first field that is wrong.

A JSON body or form takes only OpenAI's fields for it; anything else is refused by name, never
ignored. A query ignores parameters it does not know, as a newer SDK may send one more.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bij.api.batches import check_metadata, window_seconds
from bij.api.errors import BadRequest, from_validation
from bij.contract.codes import OPENAI_ENDPOINTS

M = TypeVar("M", bound=BaseModel)


class CreateBatch(BaseModel):
    """The body of POST /v1/batches (OpenAI's, all of it)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: Any = None

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v not in OPENAI_ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(OPENAI_ENDPOINTS)}, got {v!r}")
        return v

    @field_validator("completion_window")
    @classmethod
    def _window(cls, v: str) -> str:
        window_seconds(v)
        return v

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v: Any) -> dict[str, str]:
        return check_metadata(v)

    @field_validator("output_expires_after")
    @classmethod
    def _expires(cls, v: Any) -> None:
        if v is not None:
            raise ValueError("output_expires_after is not supported: a batch's output files are kept until its "
                             "output folder is removed")
        return None

    @property
    def deadline_seconds(self) -> int:
        return window_seconds(self.completion_window)


class Purpose(BaseModel):
    """The purpose field of an upload, checked on its own as soon as its part arrives (the SDK sends it
    before the file), so a refused upload is not stored first."""

    model_config = ConfigDict(extra="forbid")

    purpose: str

    @field_validator("purpose")
    @classmethod
    def _purpose(cls, v: str) -> str:
        v = v.strip()
        if v != "batch":
            raise ValueError(f"purpose must be batch (the only files this server keeps), got {v!r}")
        return v


class UploadForm(Purpose):
    """The form fields of POST /v1/files: `purpose`, and `file` (here, the name it was sent with)."""

    file: str


class ListQuery(BaseModel):
    """A list's cursor: items after the id `after`, at most `limit` of them."""

    model_config = ConfigDict(extra="ignore")

    after: str | None = None
    limit: int = Field(20, ge=1, le=100)


class ListFilesQuery(ListQuery):
    """GET /v1/files: also by purpose, newest first unless `order` is asc."""

    purpose: str | None = None
    order: Literal["asc", "desc"] = "desc"


def parse(model: type[M], data: Any, what: str) -> M:
    """`data` as `model`; a 400 naming the first wrong field (`what` says where it came from)."""
    if not isinstance(data, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(data).__name__}", None, "invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e, what, _fields(model)) from None


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)
