"""`plan_layout(module, dims, config) -> Layout`: the one place a run's plan is made.

Pure: no process group, no Lightning, and it works on a meta-device model, so the strategy (at
``connect``), the dry run (``python -m lightning_nd.plan``) and offline tools all get the same record.
Every check runs here, in the order the composer will apply the techniques.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

from torch import Tensor, nn

from lightning_nd.context_parallel.positions import describe_positions
from lightning_nd.layout.holdings import rank_holdings
from lightning_nd.layout.options import ParallelConfig, ResolvedOptions, block_class_list, jsonable, resolve_options
from lightning_nd.layout.record import ExpertsPlacement, Layout, Technique, TPEntry
from lightning_nd.layout.validate import check_config, check_model, warn
from lightning_nd.mesh.dims import ParallelDims
from lightning_nd.mesh.roles import role_groups, role_names
from lightning_nd.model.expert_lists import expert_lists
from lightning_nd.model.structure import ModelFacts, find_blocks, is_experts, read_model_facts, unsupported_experts
from lightning_nd.pipeline_parallel.schedules import ZERO_BUBBLE
from lightning_nd.pipeline_parallel.split import StagePlan, pipeline_model, split_stages, stage_ranks, used_twice
from lightning_nd.tensor_parallel.infer.hugging_face import experts_modules
from lightning_nd.tensor_parallel.infer.resolve import TPPlan, resolve_tp_plan
from lightning_nd.tensor_parallel.infer.structure import left_whole

T = TypeVar("T")


def plan_layout(
    module: nn.Module,
    dims: ParallelDims,
    config: ParallelConfig,
    *,
    precision: str | None = None,
    local_world_size: int | None = None,
    memo: PlanMemo | None = None,
) -> Layout:
    """Check ``config`` and ``module`` against ``dims`` and record what every rank will hold.

    ``module``: the LightningModule (or any ``nn.Module``) as the composer will see it; ``precision``: the
    Trainer's (``bf16-mixed`` sets FSDP's dtypes, ``bf16-true`` the parameters'); ``local_world_size``:
    processes per node, for the warning when a tp/cp/ep group spans nodes; ``memo``: a `PlanMemo` kept across
    plans of this same, unchanged module (the planner's candidates).
    """
    memo = memo if memo is not None else PlanMemo()
    notes: list[str] = []
    for message in check_config(dims.as_dict(), config):
        warn(notes, message)
    notes += dims.check_topology(local_world_size)
    options = resolve_options(dims.as_dict(), config, precision)
    classes = block_class_list(config)
    blocks, facts = memo.get(("blocks", _identities(classes or ())), lambda: _blocks_and_facts(module, classes))
    check_model(module, dims, config, blocks, facts, notes)
    block_names = tuple(name for name, _ in blocks)
    plan = None
    if dims.tp > 1:
        plan = memo.get(("tp", dims.tp, config.sequence_parallel, block_names, _identities(config.tp_plan or {})),
                        lambda: resolve_tp_plan(module, config.tp_plan, tp=dims.tp, facts=facts,
                                                sequence_parallel=config.sequence_parallel))
        if config.loss_parallel and "colwise_gather_output" not in plan.entries.values():
            raise ValueError("`NDParallel(loss_parallel=True)` needs a vocabulary-sharded output head, and the plan"
                             " has none (a head tied to the embedding stays whole). HINT: set loss_parallel=False, or"
                             " put the head in `tp_plan` as 'colwise_gather_output'.")
        if whole := left_whole(module, plan.entries, tuple(experts_modules(module))):
            warn(notes, f"The tp plan ({plan.source}) leaves these matrices of the first block whole on every tp"
                        f" rank: {', '.join(whole)}. HINT: pass `NDParallel(tp_plan=...)` naming them to split them.")
    pipeline = _plan_stages(module, blocks, dims, config, options, memo) if dims.pp > 1 else None
    experts = _experts(module, dims)
    expert_tp = _expert_tp(module, dims, config, notes)
    positions = describe_positions(module, dims.cp, config.cp_positions) if dims.cp > 1 else ""
    tp_entries = plan.entries if plan is not None else {}
    tp_sources = plan.sources if plan is not None else {}
    return Layout(
        dims={name: value for name, value in dims.as_dict().items()},
        options_given=jsonable(config), options=options, blocks=block_names,
        tp=tuple(TPEntry(name, style if isinstance(style, str) else f"custom:{type(style).__name__}",
                         tp_sources[name]) for name, style in tp_entries.items()),
        tp_source=plan.source if plan is not None else None,
        pipeline=pipeline, experts=experts,
        roles={role: role_groups(dims, role) for role in role_names(dims)},
        techniques=_techniques(module, dims, options, blocks, plan, pipeline, experts, positions, expert_tp),
        ranks=rank_holdings(module, dims, blocks=block_names, tp_entries=tp_entries, pipeline=pipeline,
                            experts={e.module: e.num_experts for e in experts}, precision=precision,
                            expert_tp=set(expert_tp)),
        warnings=tuple(notes),
    )


class PlanMemo:
    """What plans of one unchanged module share, for a caller that plans it many times (the planner ranks every
    layout of one model): its blocks and sizes, each tp plan, each stage split, computed on first use. What raises
    is not kept, so the next plan that needs it raises again."""

    def __init__(self) -> None:
        self._kept: dict[tuple, Any] = {}

    def get(self, key: tuple, compute: Callable[[], T]) -> T:
        if key not in self._kept:
            self._kept[key] = compute()
        return self._kept[key]


def _identities(given: Iterable | Mapping) -> tuple:
    """A key for what the user passed (classes, styles, lists): strings by value, anything else by identity."""
    items = given.items() if isinstance(given, Mapping) else enumerate(given)
    return tuple((key, value if isinstance(value, str) else id(value)) for key, value in items)


def _blocks_and_facts(module: nn.Module, classes: list | None) -> tuple[list[tuple[str, nn.Module]], ModelFacts]:
    blocks = find_blocks(module, classes)
    return blocks, read_model_facts(module, blocks)


def _plan_stages(module: nn.Module, blocks: list[tuple[str, nn.Module]], dims: ParallelDims, config: ParallelConfig,
                 options: ResolvedOptions, memo: PlanMemo) -> StagePlan:
    attribute, model = pipeline_model(module)
    prefix = attribute + "."
    model_blocks = [(name[len(prefix):], block) for name, block in blocks if name.startswith(prefix)]
    stages = dims.pp * options.pp_stages_per_rank
    key = ("stages", stages, tuple(name for name, _ in model_blocks), repr(config.pp_layers_per_stage),
           repr(config.pp_split))
    split = memo.get(key, lambda: split_stages(model, model_blocks, stages, layers_per_stage=config.pp_layers_per_stage,
                                               split_points=config.pp_split))
    twice = used_twice(model, split) if config.pp_schedule in ZERO_BUBBLE else []
    if twice:
        raise ValueError(
            f"`pp_schedule={config.pp_schedule!r}` splits each stage's backward into input and weight gradients, which"
            f" torch's pipelining cannot do for a weight one stage uses twice: `{prefix}{twice[0][1]}` is"
            f" `{prefix}{twice[0][0]}`{f' (and {len(twice) - 1} more)' if len(twice) > 1 else ''}."
            " HINT: use pp_schedule='interleaved_1f1b' (or '1f1b'), or untie them."
        )
    return StagePlan(attribute, split, stage_ranks(dims.pp, options.pp_stages_per_rank, config.pp_schedule))


def _experts(module: nn.Module, dims: ParallelDims) -> tuple[ExpertsPlacement, ...]:
    """Stacked experts modules and lists of experts (`lightning_nd.model.expert_lists`), in module order."""
    if dims.ep == 1:
        return ()
    lists = {found.name: found.count for found in expert_lists(module)}
    counts = {name: m.gate_up_proj.shape[0] if is_experts(m) else lists.get(name)
              for name, m in module.named_modules() if name}
    return tuple(ExpertsPlacement(name, count, count // dims.ep, "expert_dp" if dims.expert_dp > 1 else None)
                 for name, count in counts.items() if count)


def _expert_tp(module: nn.Module, dims: ParallelDims, config: ParallelConfig, notes: list[str]) -> tuple[str, ...]:
    """The experts modules split over tp (expert tensor parallelism, `lightning_nd.tensor_parallel.apply.experts`; under ep
    too, each expert is split both ways): under tp without sequence parallelism (there each tp rank routes other
    tokens), every stacked experts module, when each has nothing beyond its two stacks and an intermediate size tp
    divides, and under ep when one rank holds each expert (FSDP over experts split both ways is not implemented);
    else none (a note says why: they stay whole on every tp rank)."""
    if dims.tp == 1 or config.sequence_parallel:
        return ()
    if dims.ep > 1 and dims.expert_dp > 1:
        warn(notes, f"Experts stay whole on every tp rank: under ep={dims.ep} with {dims.expert_dp} ranks holding each"
                    " expert, FSDP would shard experts split both ways, which is not implemented. HINT: an ep equal"
                    " to dp_shard x cp splits them over tp too.")
        return ()
    found = [(name, experts) for name, experts in module.named_modules() if name and is_experts(experts)]
    for name, experts in found:
        extra, inner = unsupported_experts(experts), cast(Tensor, experts.down_proj).shape[-1]
        if extra or inner % dims.tp:
            reason = f"its {', '.join(extra)} have no tp split" if extra else f"tp={dims.tp} does not divide {inner}"
            warn(notes, f"Experts stay whole on every tp rank, each rank holding all of them: `{name}` cannot be"
                        f" split over tp ({reason}).")
            return ()
    return tuple(name for name, _ in found)


def _numel(module: nn.Module, names: list[str] | tuple[str, ...]) -> int:
    """Elements of the parameters of the modules ``names``, each module's counted once (as its ``parameters()``
    gives them), in one walk of the model instead of one per module."""
    wanted, counted, total = set(names), set(), 0
    for name, param in module.named_parameters(remove_duplicate=False):
        parts = name.split(".")[:-1]
        for owner in (".".join(parts[:end]) for end in range(len(parts) + 1)):
            if owner in wanted and (owner, id(param)) not in counted:
                counted.add((owner, id(param)))
                total += param.numel()
    return total


def _techniques(module: nn.Module, dims: ParallelDims, options: ResolvedOptions, blocks: list, plan: TPPlan | None,
                pipeline: StagePlan | None, experts: tuple[ExpertsPlacement, ...],
                positions: str, expert_tp: tuple[str, ...] = ()) -> tuple[Technique, ...]:
    """The composer's steps, in its order: pipeline split, EP, CP, TP, AC, compile, FSDP/HSDP."""
    names = [name for name, _ in blocks]
    total = sum(p.numel() for p in module.parameters())
    steps = []
    if pipeline is not None:
        steps.append(Technique("pipeline_split", "pp", tuple(pipeline.units()), total, {
            "stages": pipeline.num_stages, "source": pipeline.split.source, "split": pipeline.split.describe(),
            "schedule": options.pp_schedule, "microbatches": options.pp_microbatches}))
    if experts:
        modules = tuple(e.module for e in experts)
        steps.append(Technique("expert_parallel", "ep", modules, _numel(module, modules), {"ep": dims.ep}))
    if expert_tp:
        steps.append(Technique("expert_tensor_parallel", "tp", expert_tp, _numel(module, expert_tp), {"tp": dims.tp}))
    if dims.cp > 1:
        steps.append(Technique("context_parallel", "cp", (), 0, {"cp": dims.cp, "positions": positions}))
    if plan is not None:
        modules = tuple(plan.entries)
        steps.append(Technique("tensor_parallel", "tp", modules, _numel(module, modules), {
            "tp": dims.tp, "sequence_parallel": options.sequence_parallel,
            "loss_parallel": options.loss_parallel, "source": plan.source}))
    if options.activation_checkpointing != "none":
        steps.append(Technique("activation_checkpointing", None, tuple(names), _numel(module, names),
                               {"mode": options.activation_checkpointing}))
    if options.compile:
        steps.append(Technique("compile", None, tuple(names), _numel(module, names), {"backend": options.compile}))
    if dims.dp_enabled or dims.fsdp_enabled:
        hsdp = dims.dp_replicate > 1
        units = "each stage's blocks and the stage" if pipeline is not None else f"{len(names)} blocks and the root"
        steps.append(Technique("hsdp" if hsdp else "fsdp", "hsdp" if hsdp else "fsdp", tuple(names), total, {
            "replicate": dims.dp_replicate, "shard": dims.dp_shard * dims.cp, "zero_stage": options.zero_stage,
            "units": units}))
    return tuple(steps)
