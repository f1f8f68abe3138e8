"""Configuration: the schema, the DictConfig boundary and the shipped config groups."""
from swafactory.config.from_hydra import from_hydra
from swafactory.config.paths import GROUPS, conf_dir, group_options
from swafactory.config.schema import (BackendSpec, Geometry, ModelSpec, RunSpec, SpecConfig,
                                      SwaFactoryConfig, WorkloadSpec)

__all__ = ["from_hydra", "conf_dir", "group_options", "GROUPS", "BackendSpec", "Geometry",
           "ModelSpec", "RunSpec", "SpecConfig", "SwaFactoryConfig", "WorkloadSpec"]
