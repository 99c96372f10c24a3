"""The storage schemes, in one table: each URI prefix, the function that opens its storage (a module
under bij.storage), whether a job may write there (outputs and work files), and what names an object's
version. A new scheme is its module under bij/storage and one row here; tests/storage/test_schemes.py
holds each row to its module."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    prefix: str
    """the URI's start, e.g. "s3://" """
    opener: str
    """"module:function" under bij.storage: (uri, spec.storage.s3 or None) -> Storage"""
    writable: bool
    """outputs and work files may live here (otherwise an input only)"""
    version: str
    """what tells one version of an object from another, as a changed input is reported"""


SCHEMES: tuple[Scheme, ...] = (
    Scheme("file://", "file:open_file", True, "mtime"),
    Scheme("s3://", "s3:open_s3", True, "ETag"),
    Scheme("gs://", "s3:open_gcs", True, "ETag"),
    Scheme("https://", "http:open_http", False, "ETag"),
    Scheme("http://", "http:open_http", False, "ETag"),
    Scheme("hf://", "hf:open_hf", False, "commit"),
)
# Where a job's output, work files, a manifest or a bare `bij results` target may be.
WRITABLE = tuple(s.prefix for s in SCHEMES if s.writable)


def scheme_of(uri: str) -> Scheme | None:
    """The row of the URI's scheme; None for a scheme bij does not read."""
    return next((s for s in SCHEMES if uri.startswith(s.prefix)), None)


def prefixes(writable_only: bool = False) -> str:
    """'file://, s3:// or gs://' (the writable ones) or every prefix, for messages."""
    names = [s.prefix for s in SCHEMES if s.writable or not writable_only]
    return ", ".join(names[:-1]) + " or " + names[-1]
