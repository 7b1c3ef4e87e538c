"""A rank's pipeline stages, built from the module Lightning trains and the Layout's `StagePlan`.

The model to pipeline is the one child of the LightningModule that holds every parameter
(``self.model``); the composer replaces that child with this rank's `PipelineStages`, so the
optimizer (built afterwards from ``self.parameters()``) sees exactly the local stages' weights.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from lightning_nd.pipeline_parallel.split import StagePlan
from lightning_nd.pipeline_parallel.stage import StageModule, is_stand_in


def build_stages(module: nn.Module, plan: StagePlan, pp_rank: int) -> list[StageModule]:
    model = getattr(module, plan.attribute)
    return [StageModule(model, plan.split, index) for index in plan.ranks[pp_rank]]


def stage_blocks(stage: StageModule) -> list[tuple[str, nn.Module]]:
    return [(f"module.{name}", stage.module.get_submodule(name)) for name in stage.block_names]


def stage_tp_entries(entries: Mapping[str, object], attribute: str, stage: StageModule) -> dict[str, object]:
    """The whole model's TP plan (LightningModule names) restricted to one stage (stage names)."""
    modules = dict(stage.named_modules())
    prefix = attribute + "."
    local = {f"module.{name[len(prefix):]}": style for name, style in entries.items() if name.startswith(prefix)}
    return {name: style for name, style in local.items() if name in modules and not is_stand_in(modules[name])}
