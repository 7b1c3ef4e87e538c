"""`Layout`: the one frozen, JSON-serialisable record of what every rank of a run holds and why.

Made by `plan_layout` (pure, before any process group); `parallelize` only applies it. Every JSON file
the project writes (``layout.json``, the dry run's ``--json``, the diagnostics) uses these names.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, cast

from lightning_nd.layout.options import ResolvedOptions
from lightning_nd.pipeline_parallel.split import StageLayout, StagePlan

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

FORMAT_VERSION = 1


@dataclass(frozen=True)
class TPEntry:
    """One module split by tensor parallelism: its style and where that choice came from."""

    module: str
    style: str
    source: str
    """``explicit`` (``NDParallel(tp_plan=...)``), ``declared`` (the model's own plan), ``pattern`` (its name),
    or ``sequence_parallel`` (a residual norm added because sequence_parallel=True)."""


@dataclass(frozen=True)
class ExpertsPlacement:
    """One MoE experts module under expert parallelism."""

    module: str
    num_experts: int
    local_experts: int
    sharded_over: str | None
    """``expert_dp`` when several ranks hold the same experts (FSDP shards them over those), else None."""


@dataclass(frozen=True)
class Technique:
    """One technique the composer applies: what, over which mesh role, to which modules, how many parameters."""

    technique: str
    """tensor_parallel, expert_parallel, expert_tensor_parallel, context_parallel, pipeline_split, activation_checkpointing, compile,
    fsdp, hsdp."""
    role: str | None
    modules: tuple[str, ...]
    parameters: int
    details: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """The log line and layout-card line of this technique."""
        d = self.details
        count = f"{len(self.modules)} modules, {self.parameters:,} parameters"
        if self.technique == "tensor_parallel":
            return (f"Applied tensor parallel (tp={d['tp']}, sequence_parallel={d['sequence_parallel']},"
                    f" loss_parallel={d['loss_parallel']}) to {count}, from {d['source']}")
        if self.technique == "expert_parallel":
            return (f"Applied expert parallel (ep={d['ep']}) to {len(self.modules)} experts modules: each rank holds"
                    f" 1/{d['ep']} of the experts, tokens dispatched by all-to-all")
        if self.technique == "expert_tensor_parallel":
            return (f"Applied expert tensor parallel (tp={d['tp']}) to {len(self.modules)} experts modules: each rank"
                    f" holds 1/{d['tp']} of every expert, the partial outputs summed over tp")
        if self.technique == "context_parallel":
            return f"Applied context parallel (cp={d['cp']}, ring attention, zigzag sequence sharding){d['positions']}"
        if self.technique == "pipeline_split":
            return (f"Split the model into {d['stages']} pipeline stages from {d['source']}: {d['split']};"
                    f" schedule {d['schedule']} with {d['microbatches']} microbatches")
        if self.technique == "activation_checkpointing":
            return f"Applied {d['mode']} activation checkpointing to {len(self.modules)} blocks"
        if self.technique == "compile":
            return f"Compiled {len(self.modules)} blocks with torch.compile(backend={d['backend']!r})"
        kind = (f"HSDP (replicate={d['replicate']} x shard={d['shard']})" if self.technique == "hsdp"
                else f"FSDP (shard={d['shard']})")
        return f"Applied {kind} with zero_stage={d['zero_stage']} to {d['units']}"


@dataclass(frozen=True)
class ParamShard:
    """What one rank holds of one parameter (whole-model name)."""

    name: str
    kind: str
    """embedding, attention, mlp, experts, router, norm, head or other: for summaries."""
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placement: str
    """Per mesh role, e.g. ``fsdp:Shard(0) tp:Shard(1)``; ``replicated`` when every rank of its stage holds it whole."""
    dtype: str
    bytes: int
    """The local shard's bytes (``to_local()``)."""
    padded_bytes: int
    """Bytes of the storage FSDP allocates (its shard padded to ceil(n / shards)); equal to ``bytes`` outside FSDP."""


@dataclass(frozen=True)
class RankHolding:
    rank: int
    coordinates: dict[str, int]
    stages: tuple[int, ...]
    params: tuple[ParamShard, ...]

    @property
    def param_bytes(self) -> int:
        return sum(p.bytes for p in self.params)

    @property
    def padded_param_bytes(self) -> int:
        return sum(p.padded_bytes for p in self.params)

    def bytes_by_kind(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for param in self.params:
            totals[param.kind] = totals.get(param.kind, 0) + param.bytes
        return totals


@dataclass(frozen=True)
class Layout:
    """What a run does to the model, computed once before any process group starts."""

    dims: dict[str, int]
    options_given: dict[str, Any]
    """The `NDParallel` options as the user passed them (JSON-able form)."""
    options: ResolvedOptions
    """The same, resolved: zero stage, microbatches, stages per rank, dtypes, block classes."""
    blocks: tuple[str, ...]
    tp: tuple[TPEntry, ...]
    tp_source: str | None
    pipeline: StagePlan | None
    experts: tuple[ExpertsPlacement, ...]
    roles: dict[str, list[list[int]]]
    techniques: tuple[Technique, ...]
    ranks: tuple[RankHolding, ...]
    warnings: tuple[str, ...] = ()

    def rank(self, rank: int) -> RankHolding:
        return self.ranks[rank]

    def applies(self, technique: str) -> bool:
        """Whether the composer applies ``technique`` (a `Technique.technique` name) in this layout."""
        return any(t.technique == technique for t in self.techniques)

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: self.options.to_dict() if f.name == "options" else _plain(getattr(self, f.name))
                  for f in fields(self) if f.name != "ranks"}
        pieces: dict[int, dict[str, Any]] = {}  # ranks holding the same piece share one ParamShard
        values["ranks"] = [{
            "rank": holding.rank, "coordinates": dict(holding.coordinates), "stages": list(holding.stages),
            "params": [pieces.setdefault(id(p), asdict(p)) for p in holding.params],
            "param_bytes": holding.param_bytes, "padded_param_bytes": holding.padded_param_bytes,
        } for holding in self.ranks]
        values["version"] = FORMAT_VERSION
        return values

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Layout:
        if values.get("version", FORMAT_VERSION) > FORMAT_VERSION:
            raise ValueError(f"This Layout was written in format {values['version']}; this lightning-nd reads up to"
                             f" {FORMAT_VERSION}. HINT: upgrade lightning-nd.")
        pipeline = values["pipeline"]
        if pipeline is not None:
            split = pipeline["split"]
            pipeline = StagePlan(pipeline["attribute"], StageLayout(
                pre=tuple(split["pre"]), blocks=tuple(split["blocks"]), post=tuple(split["post"]),
                stages=tuple(tuple(units) for units in split["stages"]), source=split["source"],
                tied=tuple(tuple(pair) for pair in split.get("tied", ()))),
                tuple(tuple(stages) for stages in pipeline["ranks"]))
        ranks = tuple(RankHolding(
            r["rank"], dict(r["coordinates"]), tuple(r["stages"]),
            tuple(ParamShard(**{**p, "shape": tuple(p["shape"]), "local_shape": tuple(p["local_shape"])})
                  for p in r["params"])) for r in values["ranks"])
        return cls(
            dims=dict(values["dims"]), options_given=dict(values["options_given"]), options=ResolvedOptions.from_dict(values["options"]),
            blocks=tuple(values["blocks"]), tp=tuple(TPEntry(**e) for e in values["tp"]), tp_source=values["tp_source"],
            pipeline=pipeline, experts=tuple(ExpertsPlacement(**e) for e in values["experts"]),
            roles={k: [list(g) for g in v] for k, v in values["roles"].items()},
            techniques=tuple(Technique(t["technique"], t["role"], tuple(t["modules"]), t["parameters"],
                                       dict(t["details"])) for t in values["techniques"]),
            ranks=ranks, warnings=tuple(values.get("warnings", ())),
        )

    @classmethod
    def from_json(cls, text: str) -> Layout:
        return cls.from_dict(json.loads(text))


def _plain(value: Any) -> Any:
    """A record field as JSON-ready values (dataclasses as dicts, tuples as lists)."""
    if is_dataclass(value):
        return asdict(cast("DataclassInstance", value))
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value
