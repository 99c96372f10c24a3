"""What `decide()` reads of the cluster (`bij.control.observe`): the Job index range syntax and which Jobs are the
bij's."""

from __future__ import annotations

import pytest
from rules.builders import k8s_job, make_job

from bij.contract import codes
from bij.control import observe
from bij.control.observe import format_ranges, parse_ranges

# --- index range strings -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, indexes", [
    ("", set()),
    (None, set()),
    ("0", {0}),
    ("1,3-5,7", {1, 3, 4, 5, 7}),
    ("0-2,4-6", {0, 1, 2, 4, 5, 6}),
    (" 2 , 9 ", {2, 9}),
])
def test_parse_ranges_reads_the_job_index_syntax(text: str | None, indexes: set[int]) -> None:
    assert parse_ranges(text) == indexes


@pytest.mark.parametrize("indexes, text", [
    ([], ""),
    ([5], "5"),
    ([7, 1, 3, 4, 5], "1,3-5,7"),
    ([0, 1, 2, 3], "0-3"),
    ([2, 2, 3], "2-3"),
])
def test_format_ranges_folds_consecutive_runs(indexes: list[int], text: str) -> None:
    assert format_ranges(indexes) == text
    assert parse_ranges(format_ranges(indexes)) == set(indexes)


# --- ownership -----------------------------------------------------------------------------------------


def test_a_job_of_the_same_name_without_our_label_is_not_ours() -> None:
    foreign = k8s_job(owner_uid=None)
    del foreign["metadata"]["labels"][codes.JOB_LABEL]
    assert not observe.owns(make_job(), foreign)
    assert observe.owns(make_job(), k8s_job())
    assert not observe.owns(make_job(), k8s_job(owner_uid="someone-else"))
