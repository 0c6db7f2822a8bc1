"""Probe families and their config sections: a family is a package (or a single module) of probes that shares
one config section, one docs page and one metric prefix. Every family's config model is a `Section`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every config model: unknown keys are errors, values are frozen, defaults are validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# A family's section is a Section, or a list of them (a RootModel: `site_checks:`).
SectionT = TypeVar("SectionT", bound=BaseModel)


@dataclass(frozen=True)
class Family:
    """A probe family: a package (or a single module) of probes that shares one config section and one
    docs page. Declared in the family's `__init__.py` as `FAMILY = register_family(Family(...))`."""

    key: str  # the config section, e.g. "storage" → `storage:` in config.yaml
    module: str  # the package or module that declares it (its probes live beneath it)
    config: type[BaseModel]  # a Section, or a RootModel of a list of them
    title: str
    doc: str  # the family's docs page, relative to the repository root
    order: int = 100  # position of its section in `config --defaults`


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    existing = FAMILIES.get(family.key)
    if existing is not None and existing != family:
        raise ValueError(f"config section {family.key!r} declared twice ({existing.module}, {family.module})")
    FAMILIES[family.key] = family
    _family_of_config.cache_clear()
    return family


@functools.cache
def _family_of_config(model: type[BaseModel]) -> Family:
    for family in FAMILIES.values():
        if family.config is model:
            return family
    raise LookupError(f"{model.__name__} is not the config model of a registered family")


def family_settings(config: BaseModel, model: type[SectionT]) -> SectionT:
    """The section of `config` that holds `model` (a family's config model), typed."""
    value = getattr(config, _family_of_config(model).key)
    if not isinstance(value, model):
        raise TypeError(f"config section {_family_of_config(model).key} is {type(value).__name__}, not {model}")
    return value


def family_of(probe_class: type) -> Family | None:
    """The family a probe belongs to: the one declared by the nearest enclosing package or module."""
    module = probe_class.__module__
    best: Family | None = None
    for family in FAMILIES.values():
        if (module == family.module or module.startswith(family.module + ".")) and (
            best is None or len(family.module) > len(best.module)
        ):
            best = family
    return best


# Config field types shared by the families' models.
PositiveSeconds = Annotated[float, Field(gt=0)]
Percent = Annotated[float, Field(ge=0, le=100)]
