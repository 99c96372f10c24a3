"""contract.engines' table is what the engines are: each class matches its row, and the spec's engine
names are the table's."""

from __future__ import annotations

import typing

import pytest

from bij.contract.engines import ENGINES
from bij.contract.spec import ModelSpec
from bij.engines import engine_class


@pytest.mark.parametrize("engine,task", [(e, t) for e, row in ENGINES.items() for t in row.tasks])
def test_each_engine_and_task_has_a_class_that_schedules_as_its_row_says(engine, task):
    cls = engine_class(engine, task)
    assert cls.schedules_itself is ENGINES[engine].schedules_itself, f"{cls.__name__} for {engine}/{task}"
    # An engine that schedules itself names the spec field that bounds what it has in flight.
    assert (ENGINES[engine].in_flight is not None) is ENGINES[engine].schedules_itself


def test_the_specs_engine_names_are_the_tables():
    literal = ModelSpec.model_fields["engine"].annotation
    assert typing.get_args(literal) == tuple(ENGINES)


def test_a_task_an_engine_does_not_run_is_refused_by_name():
    with pytest.raises(ValueError, match="engine echo runs tasks embed, generate, chat, not 'rerank'"):
        engine_class("echo", "rerank")
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        engine_class("nope", "embed")
