"""A titan-models family's `ModelSpec`: what every family of this package registers the same
way (its `[model]` settings applied by `configure_args`), so that a family's `__init__.py`
says only what is its own."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from titan_core.protocols import ModelArgs, ModelFeatures, ModelSpec
from titan_models.options import configure_args


def family_spec(
    name: str,
    flavors: Mapping[str, ModelArgs],
    build: Callable[[Any], Any],
    hf_adapter: Callable[..., Any],
    features: ModelFeatures,
    block_causal_check: Callable[..., list[str]] | None = None,
) -> ModelSpec:
    """The `ModelSpec` of the family `name`: its flavors, model class and Hugging Face
    adapter, the `ModelFeatures` its models take, and `configure_args` for a run's args."""
    return ModelSpec(
        name=name,
        flavors=flavors,
        build=build,
        hf_adapter=hf_adapter,
        block_causal_check=block_causal_check,
        features=features,
        configure=configure_args,
    )
