"""A rank's pipeline stages, built from the module Lightning trains.

The model to pipeline is the one child of the LightningModule that holds every parameter
(``self.model``); the composer replaces that child with this rank's `PipelineStages`, so the
optimizer (built afterwards from ``self.parameters()``) sees exactly the local stages' weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from lightning_nd.layout.dims import ParallelDims
from lightning_nd.parallel.pipeline.stage import StageModule, is_stand_in
from lightning_nd.layout.pipeline_split import StageLayout, split_stages, stage_ranks


@dataclass
class StagePlan:
    """Where the model lives on the LightningModule, how it splits, and which stages this rank runs."""

    attribute: str
    layout: StageLayout
    ranks: list[list[int]]

    @property
    def num_stages(self) -> int:
        return len(self.layout.stages)


def pipeline_model(module: nn.Module) -> tuple[str, nn.Module]:
    """The attribute holding the whole model and the model."""
    owners = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
    if any(True for _ in module.parameters(recurse=False)) or len(owners) != 1:
        found = ", ".join(f"`{name}`" for name, _ in owners) or "none"
        raise ValueError(
            f"Pipeline parallelism splits the model held by one attribute of `{type(module).__name__}`; parameters"
            f" sit in {found}{' and on the module itself' if any(True for _ in module.parameters(recurse=False)) else ''}."
            " HINT: keep the whole network in one attribute (e.g. `self.model = MyTransformer(...)`)."
        )
    return owners[0]


def plan_stages(module: nn.Module, blocks: list[tuple[str, nn.Module]], dims: ParallelDims, config) -> StagePlan:
    """Check and compute the split (before any process group: works on a meta-device model)."""
    attribute, model = pipeline_model(module)
    prefix = attribute + "."
    model_blocks = [(name[len(prefix):], block) for name, block in blocks if name.startswith(prefix)]
    layout = split_stages(model, model_blocks, dims.pp * config.pp_stages_per_rank,
                          layers_per_stage=config.pp_layers_per_stage, split_points=config.pp_split)
    return StagePlan(attribute, layout, stage_ranks(dims.pp, config.pp_stages_per_rank, config.pp_schedule))


def build_stages(module: nn.Module, plan: StagePlan, pp_rank: int) -> list[StageModule]:
    model = getattr(module, plan.attribute)
    return [StageModule(model, plan.layout, index) for index in plan.ranks[pp_rank]]


def stage_blocks(stage: StageModule) -> list[tuple[str, nn.Module]]:
    return [(f"module.{name}", stage.module.get_submodule(name)) for name in stage.block_names]


def stage_tp_entries(entries: Mapping[str, object], attribute: str, stage: StageModule) -> dict[str, object]:
    """The whole model's TP plan (LightningModule names) restricted to one stage (stage names)."""
    modules = dict(stage.named_modules())
    prefix = attribute + "."
    local = {f"module.{name[len(prefix):]}": style for name, style in entries.items() if name.startswith(prefix)}
    return {name: style for name, style in local.items() if name in modules and not is_stand_in(modules[name])}
