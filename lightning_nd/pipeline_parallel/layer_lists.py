"""A pipeline stage's copy of a model config's per-layer lists, restricted to the blocks the stage holds."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_nd.model.structure import parent_name


def restrict_layer_lists(module: nn.Module, blocks: Sequence[str], own: set[str]) -> None:
    """A config's per-layer lists (Hugging Face's ``layer_types``, ``mlp_layer_types``) restricted to the stage's
    blocks: the model's own forward reads them by the position of each block it still holds
    (``causal_mask_mapping[self.config.layer_types[i]]`` for ``i, layer in enumerate(self.layers)``), so a later
    stage would give its first block the first layer's mask (gpt-oss: a sliding window for a full-attention layer,
    silently). The blocks read theirs by index when built, before the split. The stage's copy of the config is its
    own (the model was deep-copied)."""
    containers: dict[str, list[str]] = {}
    for name in blocks:
        containers.setdefault(parent_name(name), []).append(name)
    configs = {id(config): config for sub in module.modules() if (config := getattr(sub, "config", None)) is not None}
    for names in containers.values():
        kept = [position for position, name in enumerate(names) if name in own]
        if len(kept) == len(names):
            continue
        for config in configs.values():
            for attr, value in list(vars(config).items()):
                if attr.endswith("layer_types") and isinstance(value, (list, tuple)) and len(value) == len(names):
                    setattr(config, attr, type(value)(value[position] for position in kept))
