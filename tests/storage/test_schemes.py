"""contract.schemes' table is what opens storage: each row's opener exists in its module and gives that
module's storage, the spec's URI rule takes exactly the writable schemes, and a scheme not in the table is
refused by name."""

from __future__ import annotations

import importlib
import re

import pytest

from bij.contract.schemes import SCHEMES, WRITABLE
from bij.contract.spec_io import URI_PATTERN
from bij.storage import StorageError, open_storage


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.prefix)
def test_each_scheme_opens_the_storage_of_its_own_module(scheme, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acme;AccountKey=a2V5")  # az:// needs one
    module, name = scheme.opener.split(":")
    uri = scheme.prefix + ("tmp/x" if scheme.prefix == "file://" else "bucket/x")
    got = open_storage(uri, None)
    assert type(got).__module__ == f"bij.storage.{module}"
    assert callable(getattr(importlib.import_module(f"bij.storage.{module}"), name))


def test_the_specs_uri_rule_takes_the_writable_schemes_only():
    for scheme in SCHEMES:
        uri = scheme.prefix + "bucket/x"
        assert bool(re.match(URI_PATTERN, uri)) is (scheme.prefix in WRITABLE), uri


def test_a_scheme_not_in_the_table_is_refused_naming_the_ones_that_are():
    with pytest.raises(StorageError, match=r"unsupported URI 'ftp://h/x': use file://, s3://, gs:// or az:// "
                                           r"\(or https://, http://, hf:// for an input\)"):
        open_storage("ftp://h/x", None)
