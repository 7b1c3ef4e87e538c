"""Where a model splits into pipeline stages.

A model is read as an ordered list of *units*: the modules before the repeated blocks that own
parameters (embeddings), the blocks, and those after them (final norm, head), in the order of the
model's declared plan or of its forward (`units.py`). Stages are contiguous runs of blocks; the
first stage also holds the units before them, the last stage those after. Pure inspection: runs
on a meta-device model before any process group starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_nd.model.structure import get_submodule, model_child, owns_parameters
from lightning_nd.pipeline_parallel.schedules import V_SHAPED
from lightning_nd.pipeline_parallel.units import pipeline_units


@dataclass(frozen=True)
class StageLayout:
    """Which units each pipeline stage holds, in order, and where that split came from."""

    pre: tuple[str, ...]
    blocks: tuple[str, ...]
    post: tuple[str, ...]
    stages: tuple[tuple[str, ...], ...]
    source: str
    tied: tuple[tuple[str, str], ...] = ()
    """Weights shared by a unit before the blocks and one after them (tied input and output embeddings):
    ``(name on the first stage, name on the last stage)``, the first as one process's optimizer knows it. Each
    of the two stages holds a copy; their gradients are summed and both take the same steps."""

    def describe(self) -> str:
        split = "; ".join(f"stage {i}: {_span(units, self.blocks)}" for i, units in enumerate(self.stages))
        ties = "".join(f"; `{last}` is tied to `{first}`: a copy on the first and the last stage, gradients summed"
                       " between them" for first, last in self.tied)
        return split + ties


@dataclass(frozen=True)
class StagePlan:
    """Where the model lives on the LightningModule, how it splits, and which stages each pp rank runs."""

    attribute: str
    split: StageLayout
    ranks: tuple[tuple[int, ...], ...]
    """``ranks[r]``: the stage indices pp rank ``r`` runs (looped: r, r+pp, ...; V-shaped: r, 2pp-1-r)."""

    @property
    def num_stages(self) -> int:
        return len(self.split.stages)

    def units(self) -> list[str]:
        """The whole model's units, stage by stage (the unsplit model's order)."""
        return [unit for stage in self.split.stages for unit in stage]


def _span(units: Sequence[str], blocks: Sequence[str]) -> str:
    own = [u for u in units if u in blocks]
    before, after = units[:units.index(own[0])], units[units.index(own[-1]) + 1:]
    return " + ".join([*before, f"{own[0]}..{own[-1]}" if len(own) > 1 else own[0], *after])


def stage_ranks(pp: int, stages_per_rank: int, schedule: str) -> tuple[tuple[int, ...], ...]:
    """The stage indices each pp rank runs: looped (r, r+pp, ...) or V-shaped (r, 2pp-1-r)."""
    if schedule in V_SHAPED:
        return tuple((rank, 2 * pp - 1 - rank) for rank in range(pp))
    return tuple(tuple(rank + k * pp for k in range(stages_per_rank)) for rank in range(pp))


def split_stages(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    num_stages: int,
    *,
    layers_per_stage: Sequence[int] | None = None,
    split_points: Sequence[str] | None = None,
) -> StageLayout:
    """Assign contiguous blocks to ``num_stages`` stages: by ``layers_per_stage``, by ``split_points``
    (the block each later stage starts at), or balanced by parameter count."""
    pre, block_names, post, source = pipeline_units(model, blocks)
    if num_stages > len(block_names):
        raise ValueError(f"{num_stages} pipeline stages need at least one block each, and the model has"
                         f" {len(block_names)}. HINT: use pp * stages_per_rank <= {len(block_names)}.")
    if layers_per_stage is not None:
        counts = _checked_counts(layers_per_stage, num_stages, len(block_names))
        source = f"`pp_layers_per_stage={list(layers_per_stage)}`"
    elif split_points is not None:
        counts = _counts_from_points(split_points, block_names, num_stages)
        source = f"`pp_split={list(split_points)}`"
    else:
        sizes = [_numel(get_submodule(model, name)) for name in block_names]
        extra_first = sum(_numel(get_submodule(model, name)) for name in pre)
        extra_last = sum(_numel(get_submodule(model, name)) for name in post)
        counts = balanced_counts(sizes, num_stages, extra_first, extra_last)
        source += ", balanced by parameter count"
    stages, start = [], 0
    for index, count in enumerate(counts):
        units = block_names[start:start + count]
        stages.append(tuple((pre if index == 0 else []) + units + (post if index == num_stages - 1 else [])))
        start += count
    return StageLayout(pre=tuple(pre), blocks=tuple(block_names), post=tuple(post), stages=tuple(stages), source=source,
                       tied=_tied_weights(model, stages, pre, post))


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balanced_counts(sizes: Sequence[int], num_stages: int, extra_first: int = 0, extra_last: int = 0) -> list[int]:
    """Blocks per stage minimising the largest stage (parameters), first/last stages carrying extras;
    among equal maxima the most even split in block counts."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, start: int, end: int) -> int:
        extra = (extra_first if stage == 0 else 0) + (extra_last if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    best: dict[tuple[int, int], tuple[tuple[int, int], list[int]]] = {}

    def solve(stage: int, start: int) -> tuple[tuple[int, int], list[int]]:
        if (stage, start) in best:
            return best[(stage, start)]
        if stage == num_stages - 1:
            result = ((cost(stage, start, n), (n - start) ** 2), [n - start])
        else:
            options = []
            for end in range(start + 1, n - (num_stages - stage - 1) + 1):
                (rest_max, rest_sq), rest = solve(stage + 1, end)
                options.append(((max(cost(stage, start, end), rest_max), rest_sq + (end - start) ** 2), [end - start, *rest]))
            result = min(options, key=lambda option: option[0])
        best[(stage, start)] = result
        return result

    return solve(0, 0)[1]


def _checked_counts(counts: Sequence[int], num_stages: int, num_blocks: int) -> list[int]:
    counts = list(counts)
    if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != num_blocks:
        even = [num_blocks // num_stages + (i < num_blocks % num_stages) for i in range(num_stages)]
        raise ValueError(f"`pp_layers_per_stage={counts}` must give each of the {num_stages} stages at least one block"
                         f" and sum to the model's {num_blocks} blocks. HINT: e.g. `pp_layers_per_stage={even}`.")
    return counts


def _counts_from_points(points: Sequence[str], block_names: list[str], num_stages: int) -> list[int]:
    starts = []
    for point in points:
        if point not in block_names:
            raise ValueError(f"`pp_split` entry {point!r} is not a block of the model."
                             f" HINT: use block names such as {block_names[1]!r}.")
        starts.append(block_names.index(point))
    if len(starts) != num_stages - 1 or starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(f"`pp_split={list(points)}` must name {num_stages - 1} distinct blocks in model order, not"
                         f" the first, where stages 1..{num_stages - 1} start. HINT: e.g. {block_names[len(block_names) // 2]!r}.")
    bounds = [0, *starts, len(block_names)]
    return [bounds[i + 1] - bounds[i] for i in range(num_stages)]


def _tied_weights(
    model: nn.Module, stages: list[tuple[str, ...]], pre: list[str], post: list[str]
) -> tuple[tuple[str, str], ...]:
    """Weights that units of different stages share. Only a tie between a unit before the blocks and one after
    them is kept in step, as Megatron-LM keeps tied embeddings (`_allreduce_word_embedding_grads`,
    megatron/core/distributed/finalize_model_grads.py); any other would train two diverging copies: refused."""
    stage_of = {unit: index for index, units in enumerate(stages) for unit in units}
    holders: dict[int, list[tuple[str, str]]] = {}
    for unit in stage_of:
        for name, param in get_submodule(model, unit).named_parameters(remove_duplicate=False):
            holders.setdefault(id(param), []).append((unit, f"{unit}.{name}"))
    tied = []
    for held in holders.values():
        if len({stage_of[unit] for unit, _ in held}) == 1:
            continue
        first = [name for unit, name in held if unit in pre]
        last = [name for unit, name in held if unit in post]
        if len(first) + len(last) < len(held):
            unit_a, name_a = held[0]
            unit_b, name_b = next((unit, name) for unit, name in held if stage_of[unit] != stage_of[unit_a])
            raise ValueError(
                f"`{name_b}` and `{name_a}` are one shared weight, and pipeline parallelism puts them on stages"
                f" {stage_of[unit_b]} and {stage_of[unit_a]}. Only a weight tied between the units before the blocks"
                " and those after them (tied input and output embeddings) is kept as a copy on the first and the last"
                " stage with summed gradients. HINT: move the stage boundary so both are on one stage (`pp_split=` or"
                " `pp_layers_per_stage=`), or untie them."
            )
        tied.append((first[0], last[0]))
    return tuple(tied)


def used_twice(model: nn.Module, layout: StageLayout) -> list[tuple[str, str]]:
    """(first name, other name) of every parameter one stage holds under two names (a tie inside the stage)."""
    found = []
    for units in layout.stages:
        first: dict[int, str] = {}
        for unit in units:
            for name, param in get_submodule(model, unit).named_parameters(remove_duplicate=False):
                if first.setdefault(id(param), f"{unit}.{name}") != f"{unit}.{name}":
                    found.append((first[id(param)], f"{unit}.{name}"))
    return found


def pipeline_model(module: nn.Module) -> tuple[str, nn.Module]:
    """The attribute holding the whole model to pipeline, and the model."""
    found = model_child(module)
    if found is None:
        owners = [f"`{name}`" for name, child in module.named_children() if owns_parameters(child)]
        itself = " and on the module itself" if owns_parameters(module, recurse=False) else ""
        raise ValueError(
            f"Pipeline parallelism splits the model held by one attribute of `{type(module).__name__}`; parameters"
            f" sit in {', '.join(owners) or 'none'}{itself}."
            " HINT: keep the whole network in one attribute (e.g. `self.model = MyTransformer(...)`)."
        )
    return found
