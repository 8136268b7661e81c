"""The spec's building blocks shared by its sections: the strict base model and the checked name types."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from loraflow.spec import env_rules
from loraflow.spec import resource_names as rn


class SpecModel(BaseModel):
    """A section of the spec: unknown keys are refused, values never change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# Names a spec gives to environment variables of a step (compute.*.env, secrets): loraflow/spec/env_rules.py.
EnvName = Annotated[str, AfterValidator(env_rules.check_name)]
EnvValue = Annotated[str, AfterValidator(env_rules.check_value)]
# Names that go into Google Cloud and Kubernetes requests: loraflow/spec/resource_names.py.
Region = Annotated[str, AfterValidator(rn.check_region)]
ProjectId = Annotated[str, AfterValidator(rn.check_project)]
Image = Annotated[str, AfterValidator(rn.check_image)]
