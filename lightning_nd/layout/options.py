"""`ParallelConfig`: how to parallelize, beyond the sizes of the dims, as the user gave it, checked alone; and
`resolve_options`, the same with every default filled for these dims and this precision (what the Layout
records and the composer reads). The config object itself is never changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

from lightning_nd.context_parallel.positions import CP_POSITIONS
from lightning_nd.mesh.dims import closest_name
from lightning_nd.pipeline_parallel.schedules import check_schedule
from lightning_nd.tensor_parallel.infer.checks import is_torch_style

ZERO_STAGES = (1, 2, 3)
AC_MODES = ("none", "full", "selective")


@dataclass(kw_only=True)
class ParallelConfig:
    """How to parallelize, beyond the sizes of the dims."""

    zero_stage: Literal[1, 2, 3] | None = None
    """What FSDP shards: 3 = params+grads+optimizer (params freed after forward), 2 = params kept from
    forward to backward, 1 = only optimizer state across a gradient-accumulation window. Default: 3,
    or 2 under pipeline parallelism (each microbatch would gather the parameters again)."""
    tp_plan: Mapping[str, object] | None = None
    """Explicit TP plan: module-name pattern (``*`` = one component) -> style name or `ParallelStyle`."""
    sequence_parallel: bool = False
    """Shard the residual stream (norms, dropout) over tp along the sequence: saves activation memory."""
    loss_parallel: bool = False
    """Keep the head's logits sharded over the vocabulary; the loss is computed without gathering them."""
    block_classes: Sequence[type | str] | None = None
    """Classes (or class names) of the repeated blocks; auto-detected when None."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations per block in backward: all of them, or all but matmul/attention outputs."""
    compile: bool | str = False
    """``torch.compile`` each block; a string names the backend (True means ``"inductor"``)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 offload policy)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv, dualpipev."""
    pp_microbatches: int | None = None
    """Microbatches each batch splits into under pp; default 2 x pp. More shrink the bubble."""
    pp_stages_per_rank: int | None = None
    """Stages (virtual stages) per pp rank: 1 for gpipe/1f1b, default 2 for the looped and V-shaped schedules."""
    pp_layers_per_stage: Sequence[int] | None = None
    """Blocks per stage, first to last (e.g. [3, 4, 4, 3] for lighter end stages); default: balanced by parameters."""
    pp_split: Sequence[str] | None = None
    """Names of the blocks where stages 1, 2, ... start (e.g. ['layers.4']); the alternative to pp_layers_per_stage."""
    cp_shard_keys: Sequence[str] | None = None
    """Under cp, the dict-batch entries split along the sequence (dim 1); default: every tensor whose dim 1
    is the sequence length (the length of the first integer [batch, seq] tensor)."""
    cp_positions: Literal["position_ids", "model"] = "position_ids"
    """Under cp, how the model learns its tokens' global positions: ``position_ids`` (its forward takes them; the
    strategy passes them; a model without the argument is refused) or ``model`` (it finds them itself, e.g. from
    ``lightning_nd.context_parallel.region.current_positions()``, or uses none: nothing is passed or checked)."""

    def __post_init__(self) -> None:
        if self.zero_stage is not None and (self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool)):
            raise ValueError(f"`zero_stage={self.zero_stage!r}` is not a ZeRO stage. HINT: use one of {ZERO_STAGES}:"
                             " 3 for the least memory, 2 for less communication.")
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"`activation_checkpointing={self.activation_checkpointing!r}` is not a mode. HINT: use one of {AC_MODES}:"
                " 'selective' recomputes cheap ops only, 'full' recomputes whole blocks (least memory)."
            )
        for option in ("sequence_parallel", "loss_parallel", "cpu_offload"):
            if not isinstance(getattr(self, option), bool):
                raise TypeError(f"`{option}={getattr(self, option)!r}` must be True or False. HINT: `{option}=True`.")
        if self.cp_positions not in CP_POSITIONS:
            raise ValueError(f"`cp_positions={self.cp_positions!r}` is not a choice. HINT: use one of {CP_POSITIONS}:"
                             " 'position_ids' (the strategy passes them), 'model' (the model finds them itself).")
        self._check_tp_plan()
        self._check_block_classes()
        self._check_compile()
        if self.pp_layers_per_stage is not None and self.pp_split is not None:
            raise ValueError("`pp_layers_per_stage` and `pp_split` both say where stages split. HINT: pass one of them.")

    def _check_tp_plan(self) -> None:
        if self.tp_plan is None:
            return
        if not isinstance(self.tp_plan, Mapping):
            raise TypeError(f"`tp_plan` must map module-name patterns to styles, got {type(self.tp_plan).__name__}."
                            " HINT: `tp_plan={'layers.*.q_proj': 'colwise', 'layers.*.o_proj': 'rowwise'}`.")
        for pattern, style in self.tp_plan.items():
            if not isinstance(pattern, str) or not (isinstance(style, str) or is_torch_style(style)):
                raise TypeError(f"`tp_plan` entry {pattern!r}: {style!r} must be a name pattern mapped to a style name"
                                " or a torch `ParallelStyle`. HINT: e.g. 'colwise' or `ColwiseParallel()`.")

    def _check_block_classes(self) -> None:
        if self.block_classes is None:
            return
        classes = block_class_list(self)
        if not classes or not all(isinstance(c, (str, type)) for c in classes):
            raise TypeError(f"`block_classes={self.block_classes!r}` must be a non-empty list of classes or class"
                            " names. HINT: `block_classes=[DecoderLayer]` or `block_classes=['DecoderLayer']`.")

    def _check_compile(self) -> None:
        if isinstance(self.compile, bool):
            return
        if not isinstance(self.compile, str):
            raise TypeError(f"`compile={self.compile!r}` must be True/False or a backend name. HINT: `compile=True`.")
        import torch._dynamo

        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.compile not in backends:
            raise ValueError(f"`compile={self.compile!r}` is not a torch.compile backend."
                             f" HINT: did you mean {closest_name(self.compile, backends)!r}? Or `compile=True` (inductor).")


def block_class_list(config: ParallelConfig) -> list[type | str] | None:
    """``block_classes`` as a list (one class or name may be given alone)."""
    if config.block_classes is None:
        return None
    return [config.block_classes] if isinstance(config.block_classes, (str, type)) else list(config.block_classes)


PRECISION_DTYPES = {"bf16-mixed": ("bfloat16", "float32")}


@dataclass(frozen=True, kw_only=True)
class ResolvedOptions:
    """The options a `Layout` records and the composer applies: `ParallelConfig` with every default filled for the
    run's dims and precision, classes and torch styles by name. Its JSON keys (``to_dict``) are the fields'."""

    zero_stage: int = 3
    tp_plan: Mapping[str, str] | None = None
    """Explicit plan: pattern -> style name (a torch `ParallelStyle` by its class name)."""
    sequence_parallel: bool = False
    loss_parallel: bool = False
    block_classes: tuple[str, ...] | None = None
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: str | None = None
    """The torch.compile backend, None when blocks are not compiled."""
    cpu_offload: bool = False
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_stages_per_rank: int = 1
    pp_layers_per_stage: tuple[int, ...] | None = None
    pp_split: tuple[str, ...] | None = None
    cp_shard_keys: tuple[str, ...] | None = None
    cp_positions: str = "position_ids"
    precision: str | None = None
    """The Trainer's precision (``bf16-mixed``...), None when not known (the dry run without one)."""
    param_dtype: str | None = None
    """What FSDP gathers parameters in (half the traffic under bf16-mixed); None: their own dtype."""
    reduce_dtype: str | None = None
    """What FSDP reduces gradients in; None: their own dtype."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: sequences as lists, the plan as a dict."""
        return {f.name: _listed(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ResolvedOptions:
        """From ``to_dict``'s form (a ``layout.json``): a key this version does not know is left out, a missing one
        takes its default (files written before it existed)."""
        known = {f.name for f in fields(cls)}
        typed: dict[str, Any] = {key: (tuple(value) if isinstance(value, list) else dict(value) if isinstance(value, Mapping) else value)
                 for key, value in values.items() if key in known}
        return cls(**typed)


def _listed(value: object) -> object:
    if isinstance(value, tuple):
        return list(value)
    return dict(value) if isinstance(value, Mapping) else value


def resolve_options(sizes: dict[str, int], config: ParallelConfig, precision: str | None = None) -> ResolvedOptions:
    """Every option with its default for these dims filled in: what the composer applies."""
    stages_per_rank, microbatches = (check_schedule(config.pp_schedule, sizes["pp"], config.pp_stages_per_rank,
                                                    config.pp_microbatches) if sizes["pp"] > 1 else (1, 1))
    param_dtype, reduce_dtype = PRECISION_DTYPES.get(str(precision), (None, None))
    compile_backend = config.compile if isinstance(config.compile, str) else ("inductor" if config.compile else None)
    return ResolvedOptions.from_dict({
        **jsonable(config),
        "zero_stage": config.zero_stage if config.zero_stage is not None else (2 if sizes["pp"] > 1 else 3),
        "pp_stages_per_rank": stages_per_rank, "pp_microbatches": microbatches,
        "compile": compile_backend, "precision": precision,
        # FSDP gathers parameters in param_dtype (half the traffic under bf16-mixed) and reduces in reduce_dtype.
        "param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
    })


def jsonable(config: ParallelConfig) -> dict[str, Any]:
    """The options as given, in JSON: classes and torch styles by name."""
    def name(value: object) -> object:
        return value if isinstance(value, (str, int, float, bool, type(None))) else (
            value.__name__ if isinstance(value, type) else type(value).__name__)

    values: dict[str, Any] = {}
    for key, value in vars(config).items():
        if isinstance(value, Mapping):
            value = {str(k): name(v) for k, v in value.items()}
        elif isinstance(value, (list, tuple)):
            value = [name(v) for v in value]
        elif isinstance(value, type):
            value = [value.__name__]
        values[key] = name(value) if not isinstance(value, (dict, list)) else value
    return values
