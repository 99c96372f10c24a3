"""What every model of the BatchInferenceJob spec stands on: the base model and the small types they share.

Field names are the camelCase ones from the CRD; Python attributes are snake_case (the alias generator).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from bij.contract.schema import k8s


class SpecModel(BaseModel):
    """camelCase names as in the CRD, unknown fields refused, frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


# A string the API server refuses empty (a validator refuses it in Python).
NonEmpty = Annotated[str, Field(json_schema_extra=k8s(minLength=1))]


class SecretKeyRef(SpecModel):
    """One key of a Secret in the job's namespace."""

    name: NonEmpty
    """the Secret's name"""
    key: NonEmpty
    """the key whose value is used"""
