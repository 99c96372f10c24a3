"""The storage schemes, in one table: each URI prefix, the function that opens its storage (a module
under bij.storage), whether a job may write there (outputs and work files), and what names an object's
version, and what a valid URI of it looks like (the spec's checks and the CRD's rules are made from these
rows). A new scheme is its module under bij/storage and one row here; tests/storage/test_schemes.py holds
each row to its module."""

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
    pattern: str
    """a whole URI of the scheme (an RE2 and Python regex, without anchors): the spec and the CRD check it"""
    needs: str
    """what a URI of it names, for messages: "a bucket" """
    form: str
    """the URI's form, for messages: "s3://bucket/prefix" """


# One object at a web URL (a presigned S3 / signed GCS URL too): HTTP lists nothing, so a path to an object.
_WEB = r"://[^/?#]+/[^?#]*[^/?#](\?.*)?"

SCHEMES: tuple[Scheme, ...] = (
    Scheme("file://", "file:open_file", True, "mtime", r"file://.+", "a path",
           "file:///absolute/path or file://relative/path"),
    Scheme("s3://", "s3:open_s3", True, "ETag", r"s3://[^/]+(/.*)?", "a bucket", "s3://bucket/prefix"),
    Scheme("gs://", "s3:open_gcs", True, "ETag", r"gs://[^/]+(/.*)?", "a bucket", "gs://bucket/prefix"),
    Scheme("az://", "azure:open_azure", True, "ETag", r"az://[^/]+(/.*)?", "a container", "az://container/prefix"),
    Scheme("https://", "http:open_http", False, "ETag", "https" + _WEB, "one object", "https://host/path"),
    Scheme("http://", "http:open_http", False, "ETag", "http" + _WEB, "one object", "http://host/path"),
    Scheme("hf://", "hf:open_hf", False, "commit", r"hf://datasets/[^/@]+/[^/@]+(@[^/]+)?(/.*)?", "a dataset",
           "hf://datasets/OWNER/NAME[@REVISION]/PATH"),
)
# Where a job's output, work files, a manifest or a bare `bij results` target may be.
WRITABLE = tuple(s.prefix for s in SCHEMES if s.writable)
# Object stores bij copies from (model weights, adapters, images): the writable schemes but the local one.
REMOTE = tuple(p for p in WRITABLE if p != "file://")


def uri_pattern(writable_only: bool = False) -> str:
    """One anchored regex for a URI of any scheme (or of the writable ones)."""
    return "^(" + "|".join(s.pattern for s in SCHEMES if s.writable or not writable_only) + ")$"


def forms(writable_only: bool = False) -> str:
    """'file:///absolute/path or file://relative/path (a path), s3://bucket/prefix (a bucket), ...', for
    messages."""
    return ", ".join(f"{s.form} ({s.needs})" for s in SCHEMES if s.writable or not writable_only)


def scheme_of(uri: str) -> Scheme | None:
    """The row of the URI's scheme; None for a scheme bij does not read."""
    return next((s for s in SCHEMES if uri.startswith(s.prefix)), None)


def prefixes(writable_only: bool = False) -> str:
    """'file://, s3:// or gs://' (the writable ones) or every prefix, for messages."""
    names = [s.prefix for s in SCHEMES if s.writable or not writable_only]
    return ", ".join(names[:-1]) + " or " + names[-1]
