"""Every check of the options against the dims and against a model, before any process group or weight
moves. Each raises with the facts and a HINT; warnings are logged and returned for the Layout.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from lightning_nd.layout.options import ParallelConfig, block_class_list
from lightning_nd.mesh.dims import ParallelDims, divisors
from lightning_nd.model.batch import sequence_length
from lightning_nd.model.expert_lists import expert_lists
from lightning_nd.model.structure import ModelFacts, is_experts, unsupported_experts
from lightning_nd.pipeline_parallel.schedules import check_schedule

log = logging.getLogger("lightning_nd")


def warn(notes: list[str], message: str) -> None:
    """Log a warning and keep it for the Layout (the dry run prints what the real run would warn)."""
    log.warning(message)
    notes.append(message)


def check_config(sizes: Mapping[str, int], config: ParallelConfig) -> list[str]:
    """Options that need a dim that is off or combine badly with another; -1 (not yet known) passes.
    Returns the warnings (options that have no effect), unlogged: the plan logs them once."""
    notes: list[str] = []
    if sizes["pp"] > 1:
        _check_pipeline_config(sizes["pp"], config)
    elif sizes["pp"] == 1 and (config.pp_microbatches or config.pp_stages_per_rank or config.pp_layers_per_stage
                               or config.pp_split or config.pp_schedule != "1f1b"):
        notes.append("The `pp_*` options are ignored: pp=1, so the model is not pipelined.")
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
        notes.append("`tp_plan` is ignored: tp=1, so no layer is split.")
    return notes


def _check_pipeline_config(pp: int, config: ParallelConfig) -> None:
    check_schedule(config.pp_schedule, pp, config.pp_stages_per_rank, config.pp_microbatches)
    if config.compile:
        raise ValueError(f"`NDParallel(compile=..., pp={pp})`: compiled blocks inside pipeline stages are not supported"
                         " in this release (the zero-bubble schedules refuse them, and the stage hooks are untested"
                         " under compile). HINT: compile=False with pp, or pp=1.")
    if config.zero_stage == 1:
        raise ValueError(f"`NDParallel(zero_stage=1, pp={pp})`: the pipeline reduces gradients at the end of every"
                         " batch, so gradients cannot stay unreduced across an accumulation window."
                         " HINT: zero_stage=2 (the default under pp) or 3.")


def check_model(module: nn.Module, dims: ParallelDims, config: ParallelConfig, blocks: list[tuple[str, nn.Module]],
                facts: ModelFacts, notes: list[str]) -> None:
    """Everything about the model alone that can be wrong for these dims (the TP plan and the stage split are
    checked where they are made, in `tensor_parallel/infer/resolve.py` and `pipeline_parallel/split.py`)."""
    classes = block_class_list(config)
    if classes and not blocks:
        raise ValueError(
            f"`block_classes={classes}` matches no module of `{type(module).__name__}`."
            f" HINT: use one of the classes it contains, e.g. {_repeated_class_names(module)}."
        )
    if dims.pp > 1 and facts.num_hidden_layers is not None and dims.pp > facts.num_hidden_layers:
        raise ValueError(f"`NDParallel(pp={dims.pp})` exceeds the model's {facts.num_hidden_layers} layers."
                         f" HINT: choose pp <= {facts.num_hidden_layers}.")
    _check_batch_statistics(module, dims, config)
    if dims.pp > 1:
        check_router_logits_under_pp(module, dims.pp)
        _check_torch_transformer_under_pp(module, dims.pp)
    if dims.cp > 1:
        _check_context_parallel(module, dims.cp)
    if dims.ep > 1:
        _check_experts(module, dims.ep)
    if (dims.dp_enabled or dims.fsdp_enabled) and not blocks:
        warn(notes, "No repeated blocks found: FSDP shards the whole model as one unit (more peak memory)."
                    " Pass `NDParallel(block_classes=[...])` to shard block by block.")
    if config.sequence_parallel and dims.tp > 1:
        _check_experts_under_sequence_parallel(module, dims.tp)
    if config.sequence_parallel and not blocks:
        raise ValueError("`NDParallel(sequence_parallel=True)` needs the model's repeated blocks to bound the"
                         " sequence-parallel region, and none were found. HINT: pass `NDParallel(block_classes=[YourBlock])`.")


def _check_torch_transformer_under_pp(module: nn.Module, pp: int) -> None:
    """PyTorch's `nn.TransformerEncoder`/`nn.TransformerDecoder` read ``self.layers[0]`` in their forward; a stage
    holds only its own layers, so the container cannot be cut between stages."""
    for name, m in module.named_modules():
        if isinstance(m, (nn.TransformerEncoder, nn.TransformerDecoder, nn.Transformer)):
            raise ValueError(
                f"`NDParallel(pp={pp})`: `{name}` is a `{type(m).__name__}`, whose forward indexes its first layer,"
                " so its layers cannot be split between pipeline stages. HINT: hold the layers in your own"
                " `nn.ModuleList` and loop over them in your model's forward (each stage then runs its own), or pp=1."
            )


def check_router_logits_under_pp(module: nn.Module, pp: int, asked: bool = False) -> None:
    """A Hugging Face MoE model's load-balancing loss combines every layer's router logits into one product of
    means, which no stage can compute from its own layers: refused under pp while it counts (``asked``: the
    step passed ``output_router_logits=True``)."""
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        coef = getattr(config, "router_aux_loss_coef", 0) or 0
        if coef and (asked or getattr(config, "output_router_logits", False)):
            raise ValueError(
                f"`NDParallel(pp={pp})`: `{name or type(m).__name__}` adds a load-balancing loss over the router"
                f" logits of all its layers (router_aux_loss_coef={coef}), which a pipeline stage holding only some"
                " layers cannot compute. HINT: keep `output_router_logits=False` under pp (no auxiliary loss), or use"
                " `lightning_nd.nn.MoE`, whose per-layer losses each stage adds itself, or pp=1."
            )


def _check_batch_statistics(module: nn.Module, dims: ParallelDims, config: ParallelConfig) -> None:
    """BatchNorm normalises by the statistics of what it is given: under a dim that gives a rank part of the batch
    (dp, pp's microbatches) or of each sequence (cp, sequence parallel) they would be the part's, with no error."""
    parts = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp, "pp": dims.pp}
    split = [f"{dim}={size}" for dim, size in parts.items() if size > 1]
    split += ["sequence_parallel=True"] if config.sequence_parallel else []
    for name, m in module.named_modules():
        synced = isinstance(m, nn.SyncBatchNorm)
        if not isinstance(m, nn.modules.batchnorm._BatchNorm) or (synced and dims.pp == 1) or not split:
            continue
        what = (f"sums its statistics over every rank, and under pp={dims.pp} only its stage's ranks call it" if synced
                else "normalises by the statistics of the samples and tokens it is given, and under"
                     f" {', '.join(split)} a rank is given only part of them (its running averages drift apart too)")
        raise ValueError(
            f"`NDParallel({', '.join(split)})`: `{name}` ({type(m).__name__}) {what}, so it would train differently"
            " from one process, with no error. HINT: use LayerNorm, GroupNorm or RMSNorm; or, under dp and cp on GPU,"
            " `torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`; or, for statistics that do not train, a frozen"
            " BatchNorm (`torchvision.ops.FrozenBatchNorm2d`); or keep these dims at 1 for this model."
        )


def _check_experts_under_sequence_parallel(module: nn.Module, tp: int) -> None:
    """Sequence parallelism hands each MoE layer a sequence-sharded DTensor, which routers do not take (measured on
    Qwen3-MoE, Mixtral and DeepSeek-V2 at tp=2: "mixed torch.Tensor and DTensor" at the router)."""
    experts = [name for name, m in module.named_modules() if is_experts(m)] + [e.name for e in expert_lists(module)]
    if experts:
        raise ValueError(f"`NDParallel(tp={tp}, sequence_parallel=True)`: the MoE layer of experts `{experts[0]}` would"
                         " receive sequence-sharded activations, which routing does not take in this release."
                         " HINT: sequence_parallel=False (tp still splits attention and experts).")


def _check_experts(module: nn.Module, ep: int) -> None:
    experts = [(name, m) for name, m in module.named_modules() if is_experts(m)]
    for name, m in experts:
        if extra := unsupported_experts(m):
            raise ValueError(f"`NDParallel(ep={ep})`: experts module `{name}` has parameters expert parallelism does"
                             f" not carry ({', '.join(extra)}): only stacked `gate_up_proj`/`down_proj` SwiGLU experts"
                             " are supported. HINT: use ep=1 for this model.")
    counts = {m.gate_up_proj.shape[0] for _, m in experts} | {e.count for e in expert_lists(module)}
    if not counts:
        raise ValueError(f"`NDParallel(ep={ep})` found no experts module (stacked `gate_up_proj`/`down_proj` weights,"
                         " as `lightning_nd.nn.moe.MoE` and Hugging Face MoE models have, or a `ModuleList` of"
                         " identical MLPs beside the gate that scores them). HINT: use ep=1.")
    for count in sorted(counts):
        if count % ep:
            raise ValueError(f"`NDParallel(ep={ep})` does not divide an experts module's {count} experts."
                             f" HINT: choose ep from {divisors(count)}.")


ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
"""Hugging Face config fields of attention-weight dropout (Llama and most decoders, GPT-2 and GPT-J, BERT)."""


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_context_parallel(module: nn.Module, cp: int) -> None:
    """Hugging Face attention settings ring attention cannot honour: another kernel, windowed attention, attention
    dropout (`context_parallel/region.py` refuses it at the first step; here it is refused before any)."""
    for name, submodule in module.named_modules():
        config = getattr(submodule, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation not in (None, "sdpa"):
            fix = ("build the model with `attn_implementation=\"sdpa\"`, or use cp=1"
                   if getattr(submodule, "_supports_sdpa", True) else
                   f"`{type(submodule).__name__}` has no SDPA path in `transformers` (`_supports_sdpa` is False):"
                   " use cp=1 and split the model with tp, pp or dp")
            raise ValueError(
                f"`NDParallel(cp={cp})` routes scaled-dot-product attention to ring attention, and"
                f" `{name or 'model'}` uses attn_implementation={implementation!r}. HINT: {fix}."
            )
        dropout = next((attr for attr in ATTENTION_DROPOUT if _positive(getattr(config, attr, None))), None)
        if dropout:
            raise ValueError(
                f"`NDParallel(cp={cp})`: `{name or 'model'}` drops attention weights in training"
                f" ({dropout}={getattr(config, dropout)}), which ring attention does not implement. HINT: build its"
                f" config with `{dropout}=0.0` (evaluation drops nothing either way), or use cp=1."
            )
        attr = next((attr for attr in ("sliding_window", "attention_chunk_size") if getattr(config, attr, None)), None)
        if attr:
            window = getattr(config, attr)
            raise ValueError(
                f"`NDParallel(cp={cp})`: `{name or 'model'}` attends within a window of {window} tokens"
                " (sliding-window or chunked attention), which ring attention does not implement. HINT: use cp=1"
                f" for this model; or, if no sequence is longer than {window} tokens (the window then changes"
                f" nothing), build its config with `{attr}=None`."
            )


def _repeated_class_names(module: nn.Module) -> list[str]:
    counts: dict[str, int] = {}
    for child in module.modules():
        counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    return sorted(name for name, count in counts.items() if count > 1)[:5]


def check_sequence_lengths(batch: object, tp: int) -> None:
    """Sequence parallel splits dim 1 of every activation over tp: the batch's sequence length must divide by it."""
    length = sequence_length(batch)
    if length is not None and length % tp:
        raise ValueError(
            f"`NDParallel(sequence_parallel=True, tp={tp})` splits the sequence over tp, but the batch's sequence"
            f" length {length} does not divide by {tp}. HINT: pad or crop sequences to a multiple of"
            f" {tp}, or set sequence_parallel=False."
        )
