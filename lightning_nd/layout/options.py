"""`ParallelConfig` (how to parallelize, beyond the sizes of the dims) and every check of a config,
alone, against the dims, and against a model. All run before any process group or weight moves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_nd.layout.dims import ParallelDims, closest_name, divisors
from lightning_nd.parallel.pipeline.schedule import check_schedule
from lightning_nd.layout.tp_plan import TPPlan, resolve_tp_plan
from lightning_nd.layout.structure import find_blocks, read_model_facts

log = logging.getLogger("lightning_nd")

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
    param_dtype: torch.dtype | None = None
    """FSDP compute dtype for parameters (set from `bf16-mixed` by the strategy)."""
    reduce_dtype: torch.dtype | None = None
    """FSDP gradient-reduction dtype."""

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
            if not isinstance(pattern, str) or not isinstance(style, (str, ParallelStyle)):
                raise TypeError(f"`tp_plan` entry {pattern!r}: {style!r} must be a name pattern mapped to a style name"
                                " or a torch `ParallelStyle`. HINT: e.g. 'colwise' or `ColwiseParallel()`.")

    def _check_block_classes(self) -> None:
        if self.block_classes is None:
            return
        if isinstance(self.block_classes, (str, type)):
            self.block_classes = [self.block_classes]
        self.block_classes = list(self.block_classes)
        if not self.block_classes or not all(isinstance(c, (str, type)) for c in self.block_classes):
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


def check_config(sizes: Mapping[str, int], config: ParallelConfig) -> None:
    """Options that need a dim that is off or combine badly with another; -1 (not yet known) passes."""
    if sizes["pp"] > 1:
        _check_pipeline_config(sizes["pp"], config)
    elif sizes["pp"] == 1 and (config.pp_microbatches or config.pp_stages_per_rank or config.pp_layers_per_stage
                               or config.pp_split or config.pp_schedule != "1f1b"):
        log.warning("The `pp_*` options are ignored: pp=1, so the model is not pipelined.")
    if config.zero_stage is None and sizes["pp"] != -1:
        config.zero_stage = 2 if sizes["pp"] > 1 else 3
    if sizes["ep"] > 1 and config.sequence_parallel:
        raise ValueError(f"`NDParallel(ep={sizes['ep']}, sequence_parallel=True)`: the MoE layers would receive"
                         " sequence-sharded activations, which expert dispatch does not take in this release."
                         " HINT: sequence_parallel=False with ep (tp still splits attention).")
    if sizes["ep"] > 1 and config.cpu_offload:
        raise ValueError(f"`NDParallel(ep={sizes['ep']}, cpu_offload=True)`: expert weights stay outside FSDP, so its"
                         " offloading would not move them. HINT: cpu_offload=False with ep.")
    if sizes["ep"] > 1 and config.compile:
        raise ValueError(f"`NDParallel(compile=..., ep={sizes['ep']})`: expert dispatch inside compiled blocks is not"
                         " supported in this release. HINT: compile=False with ep, or ep=1.")
    if config.compile and sizes["cp"] > 1:
        raise ValueError(f"`NDParallel(compile=..., cp={sizes['cp']})`: ring attention inside compiled blocks is not"
                         " supported in this release. HINT: compile=False with cp, or cp=1.")
    if config.compile and sizes["tp"] > 1:
        raise ValueError(
            f"`NDParallel(compile=..., tp={sizes['tp']})`: compiled blocks with tensor parallelism gave wrong gradients"
            " in our parity test (torch 2.13, gloo), so this release refuses the combination."
            " HINT: compile with tp=1 (FSDP/HSDP layouts), or keep tp and set compile=False."
        )
    for option in ("sequence_parallel", "loss_parallel"):
        if getattr(config, option) and sizes["tp"] == 1:
            raise ValueError(
                f"`NDParallel({option}=True)` splits work over tp, but tp=1. HINT: set tp > 1 or {option}=False."
            )
    if config.tp_plan and sizes["tp"] == 1:
        log.warning("`tp_plan` is ignored: tp=1, so no layer is split.")


def _check_pipeline_config(pp: int, config: ParallelConfig) -> None:
    config.pp_stages_per_rank, config.pp_microbatches = check_schedule(
        config.pp_schedule, pp, config.pp_stages_per_rank, config.pp_microbatches)
    if config.compile:
        raise ValueError(f"`NDParallel(compile=..., pp={pp})`: compiled blocks inside pipeline stages are not supported"
                         " in this release (the zero-bubble schedules refuse them, and the stage hooks are untested"
                         " under compile). HINT: compile=False with pp, or pp=1.")
    if config.zero_stage == 1:
        raise ValueError(f"`NDParallel(zero_stage=1, pp={pp})`: the pipeline reduces gradients at the end of every"
                         " batch, so gradients cannot stay unreduced across an accumulation window."
                         " HINT: zero_stage=2 (the default under pp) or 3.")


def check_model(
    module: nn.Module, dims: ParallelDims, config: ParallelConfig
) -> tuple[list[tuple[str, nn.Module]], TPPlan | None]:
    """Everything about the model that can be wrong for these dims; returns its blocks and TP plan."""
    blocks = find_blocks(module, config.block_classes)
    facts = read_model_facts(module, blocks)
    if config.block_classes and not blocks:
        raise ValueError(
            f"`block_classes={list(config.block_classes)}` matches no module of `{type(module).__name__}`."
            f" HINT: use one of the classes it contains, e.g. {_repeated_class_names(module)}."
        )
    if dims.pp > 1 and facts.num_hidden_layers is not None and dims.pp > facts.num_hidden_layers:
        raise ValueError(f"`NDParallel(pp={dims.pp})` exceeds the model's {facts.num_hidden_layers} layers."
                         f" HINT: choose pp <= {facts.num_hidden_layers}.")
    if dims.cp > 1:
        _check_context_parallel(module, dims.cp)
    if dims.pp > 1:
        from lightning_nd.parallel.pipeline.build import plan_stages

        plan_stages(module, blocks, dims, config)
    if dims.ep > 1:
        _check_experts(module, dims.ep)
    if (dims.dp_enabled or dims.fsdp_enabled) and not blocks:
        log.warning("No repeated blocks found: FSDP shards the whole model as one unit (more peak memory)."
                    " Pass `NDParallel(block_classes=[...])` to shard block by block.")
    if config.sequence_parallel and not blocks:
        raise ValueError("`NDParallel(sequence_parallel=True)` needs the model's repeated blocks to bound the"
                         " sequence-parallel region, and none were found. HINT: pass `NDParallel(block_classes=[YourBlock])`.")
    if not dims.tp_enabled:
        return blocks, None
    plan = resolve_tp_plan(module, config.tp_plan, tp=dims.tp, facts=facts, sequence_parallel=config.sequence_parallel)
    if config.loss_parallel and "colwise_gather_output" not in plan.entries.values():
        raise ValueError("`NDParallel(loss_parallel=True)` needs a vocabulary-sharded output head, and the plan has"
                         " none (a head tied to the embedding stays whole). HINT: set loss_parallel=False, or put the"
                         " head in `tp_plan` as 'colwise_gather_output'.")
    return blocks, plan


def _check_experts(module: nn.Module, ep: int) -> None:
    from lightning_nd.parallel.expert import is_experts, unsupported_experts

    experts = [(name, m) for name, m in module.named_modules() if is_experts(m)]
    for name, m in experts:
        if extra := unsupported_experts(m):
            raise ValueError(f"`NDParallel(ep={ep})`: experts module `{name}` has parameters expert parallelism does"
                             f" not carry ({', '.join(extra)}): only stacked `gate_up_proj`/`down_proj` SwiGLU experts"
                             " are supported. HINT: use ep=1 for this model.")
    counts = {m.gate_up_proj.shape[0] for _, m in experts}
    if not counts:
        raise ValueError(f"`NDParallel(ep={ep})` found no experts module (stacked `gate_up_proj`/`down_proj` weights,"
                         " as `lightning_nd.nn.moe.MoE` and Hugging Face MoE models have). HINT: use ep=1.")
    for count in sorted(counts):
        if count % ep:
            raise ValueError(f"`NDParallel(ep={ep})` does not divide an experts module's {count} experts."
                             f" HINT: choose ep from {divisors(count)}.")


def _check_context_parallel(module: nn.Module, cp: int) -> None:
    """Hugging Face attention settings ring attention cannot honour: another kernel, windowed attention."""
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in (None, "sdpa"):
            raise ValueError(
                f"`NDParallel(cp={cp})` routes scaled-dot-product attention to ring attention, and"
                f" `{name or 'model'}` uses attn_implementation={implementation!r}. HINT: build the model with"
                " `attn_implementation=\"sdpa\"`, or use cp=1."
            )
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        if window:
            raise ValueError(
                f"`NDParallel(cp={cp})`: `{name or 'model'}` attends within a window of {window} tokens"
                " (sliding-window or chunked attention), which ring attention does not implement. HINT: use cp=1"
                " for this model."
            )


def _repeated_class_names(module: nn.Module) -> list[str]:
    counts: dict[str, int] = {}
    for child in module.modules():
        counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    return sorted(name for name, count in counts.items() if count > 1)[:5]
