"""Where the dry run gets its model: ``MODULE:FACTORY`` or a Hugging Face config, built on the meta device.

A factory may return an ``nn.Module`` or a LightningModule; a LightningModule that builds its model in
``configure_model`` is probed later as `NDParallel` probes it (a meta-device copy). A plain ``nn.Module`` is held
by a container under ``model``, as a LightningModule holds it (``self.model``), so names, the pipeline
split and every error read as in a real run.

A Hugging Face config is built in the dtype the Trainer's precision trains in (`storage_dtype`): its own ``dtype``
(often bfloat16) is how a checkpoint is stored, not how mixed precision keeps the weights it updates (fp32 masters,
bf16 compute). A factory's parameters are priced as it builds them; `storage_line` says which.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_nd.runtime.probe import lightning_base

TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64, "64": torch.float64}


def storage_dtype(precision: str | None) -> torch.dtype:
    """The dtype a run at ``precision`` keeps its parameters (and so gradients and optimizer state) in: the
    ``*-true`` precisions' own; fp32 for ``32-true`` and every ``*-mixed`` one (FSDP casts to bf16/fp16 for compute
    only, the sharded fp32 parameters are the master weights)."""
    return TRUE_DTYPES.get(str(precision), torch.float32)


def storage_line(module: nn.Module, precision: str, config_dtype: object = None) -> str:
    """One sentence: in which dtype the parameters are priced, and why."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()})
    kept = str(storage_dtype(precision)).removeprefix("torch.")
    line = f"Parameters priced in {', '.join(dtypes) or kept}, as {precision} keeps them"
    if config_dtype is not None and str(config_dtype).removeprefix("torch.") != kept:
        return f"{line} (the config's dtype, {str(config_dtype).removeprefix('torch.')}, is its checkpoint's storage)."
    if precision.endswith("-mixed") and dtypes and dtypes != ["float32"] and config_dtype is None:
        return (f"{line}: the model is built in {', '.join(dtypes)}, so {precision} keeps no fp32 master weights."
                " HINT: build it in float32 for mixed precision, or use the matching *-true precision.")
    return line + "."


class Holder(nn.Module):
    """Stands in for the LightningModule: the model under ``model``; ``config_dtype``: a Hugging Face config's own."""

    def __init__(self, model: nn.Module, config_dtype: object = None) -> None:
        super().__init__()
        self.model, self.config_dtype = model, config_dtype


def load_factory(spec: str) -> Any:
    """``package.module:callable`` (the current directory is importable, as for ``python -m``)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"`--model {spec}` must name MODULE:FACTORY. HINT: e.g. `--model examples.models.llama:Llama`.")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"`--model {spec}`: {error}. HINT: MODULE must be importable from this directory and"
                         " FACTORY a callable in it.") from error
    if not callable(factory):
        raise ValueError(f"`--model {spec}`: `{attribute}` is not callable. HINT: name a function or class.")
    return factory


def hf_config(path: str | None, model_type: str | None, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    if path is not None:
        values = json.loads(Path(path).read_text())
        values.update(kwargs)
        model_type = values.pop("model_type", model_type)
        if model_type is None:
            raise ValueError(f"`--hf-config {path}` has no `model_type`. HINT: add --hf-model-type llama (or the family).")
        return AutoConfig.for_model(model_type, **values)
    return AutoConfig.for_model(model_type, **kwargs)


def build_model(spec: str | None, hf_path: str | None, hf_model_type: str | None, hf_kwargs: dict[str, Any],
                precision: str | None = None) -> nn.Module:
    """The module the strategy would plan, with every parameter on the meta device; from a Hugging Face config in
    `storage_dtype` (``precision``), the config's own dtype kept as ``config_dtype`` on the holder."""
    if spec is None:
        from transformers import AutoModelForCausalLM

        config = hf_config(hf_path, hf_model_type, hf_kwargs)
        stored = getattr(config, "dtype", None)  # before building: transformers sets it to the dtype built in
        try:
            with torch.device("meta"):  # transformers picks the attention a run of it gets: sdpa, or eager (gemma2)
                model = AutoModelForCausalLM.from_config(config, dtype=storage_dtype(precision))
            return Holder(model, stored)
        except (AssertionError, ValueError, TypeError) as error:  # the family's own checks of its config
            raise ValueError(f"transformers could not build {type(config).__name__}: {error or type(error).__name__}. "
                             "HINT: fix the setting it names in --hf-kwargs or --hf-config (a small vocab_size needs "
                             "pad_token_id, bos_token_id and eos_token_id below it).") from error
    factory = load_factory(spec)
    with torch.device("meta"):
        built = factory()
    if not isinstance(built, nn.Module):
        raise ValueError(f"`--model {spec}` returned {type(built).__name__}, not an nn.Module or a LightningModule.")
    if lightning_base(built) is not None:
        return built  # probed like `NDParallel.connect` probes it (`plan_for`)
    return Holder(built)
