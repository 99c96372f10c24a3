"""JobStatus.read: the status as the operator and its pods wrote it, typed; what does not parse is named."""

from __future__ import annotations

from bij.contract.status import JobStatus


def test_a_status_as_the_operator_writes_it_reads_typed() -> None:
    st = JobStatus.read({
        "phase": "Running", "round": 1, "observedGeneration": 3, "message": "round 1: 2/8 shards",
        "shards": {"done": 2, "total": 8}, "shardsSummary": "2/8", "rows": {"done": 40, "failed": 1},
        "lanes": {"done": 0, "failed": 0, "active": 2, "total": 2, "replaced": 1},
        "rounds": [{"round": 0, "shards": 4, "completionTime": "2026-01-01T00:00:00Z", "approved": 30},
                   {"round": 1, "shards": 8, "startTime": "2026-01-01T00:01:00Z"}],
        "conditions": [{"type": "Running", "status": "True", "reason": "Running", "message": "m"}],
        "workerPermissions": {"serviceAccount": "bij-worker", "result": "Granted", "checks": 1},
        "reports": {"lanes": {"p0": {"round": 1, "lane": 0, "rows": 10}}},
        "fromANewerOperator": {"kept": True},
    })
    assert st.problems == []
    assert (st.phase, st.round, st.observed_generation) == ("Running", 1, 3)
    assert st.rows is not None and st.rows.done == 40 and st.lanes is not None and st.lanes.replaced == 1
    assert [r.round for r in st.rounds] == [0, 1] and st.rounds[0].finished and not st.rounds[1].finished
    assert st.conditions[0].status == "True"
    assert st.worker_permissions is not None and st.worker_permissions.result == "Granted"


def test_each_unreadable_entry_is_named_and_the_rest_kept() -> None:
    st = JobStatus.read({
        "phase": "Running", "round": "one", "rows": {"done": "many"},
        "rounds": [{"round": 0}, {"shards": 3}, "junk"],
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "Ready", "status": "Maybe"}],
    })
    assert st.phase == "Running" and st.round is None and st.rows is None
    assert [r.round for r in st.rounds] == [0] and [c.type for c in st.conditions] == ["Ready"]
    named = {p.split(":")[0] for p in st.problems}
    assert named == {"status.round", "status.rows", "status.rounds[1]", "status.rounds[2]", "status.conditions[1]"}
    assert any(p.startswith("status.rows: done:") for p in st.problems)


def test_an_empty_or_missing_status_reads_as_nothing_yet() -> None:
    for raw in (None, {}):
        st = JobStatus.read(raw)
        assert st.phase is None and st.rounds == [] and st.problems == []


def test_a_status_patch_names_only_fields_of_the_status_under_their_own_names() -> None:
    """StatusPatch lists the status fields the operator writes beside JobStatus, which reads them: a field
    added to one and not the other, or spelled apart, fails here rather than writing a key nothing reads."""
    from bij.contract.status import StatusPatch

    status = {name: field.alias or name for name, field in JobStatus.model_fields.items()}
    for name, field in StatusPatch.model_fields.items():
        assert name in status, f"StatusPatch.{name} is no field of JobStatus"
        assert (field.alias or name) == status[name]
