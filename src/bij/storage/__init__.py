"""One storage interface for `file://` (file.py), `s3://` and `gs://` (s3.py), and the read-only
`https://` and `hf://` inputs (http.py, hf.py), opened by the URI's scheme (contract.schemes' table).

Everything bij reads or writes goes through `Storage` (base.py): listing with sizes, ranged streaming
reads, atomic whole-object writes, and (file:// only) durable appends.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from bij.contract.schemes import SCHEMES, prefixes, scheme_of
from bij.storage.base import Storage, split_blocks, split_lines
from bij.storage.file import FileStorage
from bij.storage.objects import (
    NotFound,
    ObjectChanged,
    ObjectInfo,
    ObjectPage,
    StorageError,
    StorageRefused,
)
from bij.storage.s3 import GCS_ENDPOINT, S3Storage, split_s3


def open_storage(uri: str, s3: Any) -> Storage:
    """The storage for a URI's scheme (contract.schemes' table), with the S3 settings of the job it belongs to.

    `s3` is the job's spec.storage.s3 (the spec's object, or its camelCase dict as a publish plan
    carries it): every caller says whose settings it uses. None only where no spec can be known yet
    and the standard AWS environment is the setting: a worker reading its plan (the Job sets
    AWS_ENDPOINT_URL and AWS_REGION from the spec), or a bare URI given on the command line.
    What the spec sets wins over the environment.
    """
    scheme = scheme_of(uri)
    if scheme is None:
        raise StorageError(f"unsupported URI {uri!r}: use {prefixes(writable_only=True)} (or "
                           f"{', '.join(s.prefix for s in SCHEMES if not s.writable)} for an input)", permanent=True)
    module, name = scheme.opener.split(":")
    opener: Callable[[str, Any], Storage] = getattr(importlib.import_module(f"bij.storage.{module}"), name)
    return opener(uri, s3)


__all__ = ["GCS_ENDPOINT", "FileStorage", "NotFound", "ObjectChanged", "ObjectInfo",
           "ObjectPage", "S3Storage", "Storage", "StorageError", "StorageRefused", "open_storage", "split_blocks",
           "split_lines", "split_s3"]
