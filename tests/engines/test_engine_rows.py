"""contract.engines' table is what the engines are: each class matches its row, and the spec's engine
names are the table's; each engine's options are the spec's, typed, from the spec to the engine."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from bij.contract.engines import ENGINES
from bij.contract.spec import SpecError, parse_spec
from bij.contract.spec_model import ENGINE_OPTIONS, ModelSpec, VllmOptions
from bij.engines import EngineConfig, create_engine, engine_class


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


@pytest.mark.parametrize("engine", list(ENGINE_OPTIONS))
def test_an_engines_options_are_the_spec_field_named_after_it(engine):
    assert engine in ENGINES
    assert ENGINE_OPTIONS[engine] in typing.get_args(ModelSpec.model_fields[engine].annotation) + (
        ModelSpec.model_fields[engine].annotation,)


def test_an_unknown_option_names_itself_and_its_engine_in_the_spec_and_in_a_config_built_by_hand():
    base = {"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"}}
    with pytest.raises(SpecError, match=r"spec\.model\.vllm\.maxNumSeq: engine vllm has no option 'maxNumSeq' "
                                        r"\(model\.vllm takes gpuMemoryUtilization, maxNumSeqs, "):
        parse_spec({**base, "model": {"engine": "vllm", "name": "m", "vllm": {"maxNumSeq": 4}}})
    with pytest.raises(ValueError, match=r"model\.simulated\.steps: engine simulated has no option 'steps'"):
        EngineConfig(task="generate", simulated={"steps": 3})
    with pytest.raises(ValueError, match=r"model\.http\.maxInFlight: Input should be greater than or equal to 1"):
        EngineConfig(task="generate", http={"baseUrl": "http://h:1", "maxInFlight": 0})


def test_engines_get_their_options_typed_as_the_spec_parsed_them():
    from bij.worker.main import engine_config

    spec = parse_spec({"input": {"uri": "file:///in"}, "output": {"uri": "file:///out"},
                       "model": {"engine": "simulated", "task": "generate",
                                 "simulated": {"maxNumSeqs": 3, "stepSeconds": 0}}})
    config = engine_config(spec)
    assert config.simulated is spec.model.simulated  # passed on, not copied into a mapping
    engine = create_engine("simulated", config)
    assert (engine.concurrency(), engine.step_seconds) == (3, 0)
    # A config built by hand takes the spec's mapping, camelCase or snake_case: the same options.
    camel = EngineConfig(vllm={"maxNumSeqs": 4, "toolCallParser": "hermes", "engineArgs": {"swap_space": 1}})
    snake = EngineConfig(vllm={"max_num_seqs": 4, "tool_call_parser": "hermes", "engine_args": {"swap_space": 1}})
    assert camel.vllm == snake.vllm == VllmOptions(max_num_seqs=4, tool_call_parser="hermes",
                                                  engine_args={"swap_space": 1})


def test_an_engine_config_has_a_field_for_each_engines_options():
    fields = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    for engine, options in ENGINE_OPTIONS.items():
        assert options.__name__ in str(fields[engine]), engine
