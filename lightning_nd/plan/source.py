"""Where the dry run gets its model: ``MODULE:FACTORY`` or a Hugging Face config, built on the meta device.

A factory may return an ``nn.Module`` or a LightningModule; a LightningModule that builds its model in
``configure_model`` is probed later as `NDParallel` probes it (a meta-device copy). A plain ``nn.Module`` is held
by a container under ``model``, as a LightningModule holds it (``self.model``), so names, the pipeline
split and every error read as in a real run.
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


class Holder(nn.Module):
    """Stands in for the LightningModule: the model under ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


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


def build_model(spec: str | None, hf_path: str | None, hf_model_type: str | None, hf_kwargs: dict[str, Any]) -> nn.Module:
    """The module the strategy would plan, with every parameter on the meta device."""
    if spec is None:
        from transformers import AutoModelForCausalLM

        config = hf_config(hf_path, hf_model_type, hf_kwargs)
        try:
            with torch.device("meta"):  # transformers picks the attention a run of it gets: sdpa, or eager (gemma2)
                return Holder(AutoModelForCausalLM.from_config(config))
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
