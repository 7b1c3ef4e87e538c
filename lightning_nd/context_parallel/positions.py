"""Positions under context parallelism: whether the model will see the global positions of its sequence shard.

Under cp a rank holds a head-tail shard of every sequence (`context_parallel/sharding.py`): at cp=2 and 8
tokens, rank 0 holds positions 0, 1, 6, 7. A model that derives positions from its input's length
(``torch.arange(x.shape[1])``, a learned table sliced ``[:seq]``, sinusoidal encodings, ALiBi or relative
biases from the length) would place those tokens at 0..3 and train wrong with no error. So the plan asks
how the model gets its positions, by ``cp_positions``:

- ``"position_ids"`` (default): its ``forward`` takes ``position_ids``, and the strategy passes the global
  positions there (`region.inject_positions`). A model without the argument, or one whose config declares
  length-derived position biases, is refused.
- ``"model"``: the model finds its global positions itself (it reads
  `lightning_nd.context_parallel.region.current_positions()`, or uses none); nothing about it is checked
  and nothing is passed to it.
"""

from __future__ import annotations

import functools
import inspect
import re

from torch import nn

from lightning_nd.model.structure import model_of

CP_POSITIONS = ("position_ids", "model")
LENGTH_BIASES = {"alibi": True, "position_embedding_type": ("alibi", "relative_key", "relative_key_query")}
_POSITION_NAME = re.compile(r"position|rotary|sinusoid|(^|_)(pos|wpe|pe)(_|$)", re.IGNORECASE)


@functools.cache
def forward_signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def accepts_positions(model: nn.Module) -> bool:
    return "position_ids" in forward_signature(type(model).forward).parameters


def describe_positions(module: nn.Module, cp: int, mode: str) -> str:
    """How ``module``'s model gets global positions under ``cp`` (the cp Technique's detail); raises with a
    HINT where it would compute them from its shard."""
    model = model_of(module)
    name = type(model).__name__
    if mode == "model":
        return f": `{name}` finds its global positions itself (cp_positions='model')"
    if bias := _length_bias(model):
        raise ValueError(
            f"`NDParallel(cp={cp})`: `{name}` {bias}, which it computes from the length of its input; under cp"
            f" that is this rank's shard, 1/{cp} of each sequence, so the biases would be wrong."
            " HINT: use cp=1 for this model, or rotary/absolute positions taken from `position_ids`."
        )
    if accepts_positions(model):
        return f": `{name}` gets global `position_ids`"
    found = position_sources(model)
    seen = f" It holds {', '.join(found)}." if found else ""
    raise ValueError(
        f"`NDParallel(cp={cp})`: `{name}.forward` takes no `position_ids`. Under cp it sees only this rank's"
        f" head-tail shard of each sequence (1/{cp} of the tokens, not in order), so positions or masks it"
        f" derives from its input's length would be wrong, with no error.{seen} HINT: give `{name}.forward` a"
        " `position_ids` argument ([batch, seq]; 0..seq-1 when None) and take positions from it: the strategy"
        " passes each token's global position there. If the model already finds its global positions itself"
        " (`lightning_nd.context_parallel.region.current_positions()`) or uses none, pass"
        " `NDParallel(cp_positions='model')`. Otherwise use cp=1."
    )


def position_sources(model: nn.Module) -> list[str]:
    """What in ``model`` looks like positions or masks of its own: tables, buffers and modules named like
    positions, and torch's attention modules (their causal masks are built by the caller from the length)."""
    found: list[str] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f"{outer}.") for outer in inside):
            continue
        if isinstance(module, nn.Embedding) and _POSITION_NAME.search(name.rsplit(".", 1)[-1]):
            found.append(f"`{name}` (an embedding named like a position table)")
        elif name and _POSITION_NAME.search(type(module).__name__):
            found.append(f"`{name}` ({type(module).__name__})")
        elif isinstance(module, (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder)):
            found.append(f"`{name or 'model'}` ({type(module).__name__}: its masks are built from the input's length)")
        else:
            continue
        inside.append(name)
    for name, _ in model.named_buffers():
        if _POSITION_NAME.search(name.rsplit(".", 1)[-1]):
            found.append(f"buffer `{name}`")
    return found[:6]


def _length_bias(model: nn.Module) -> str | None:
    """A Hugging Face config that declares position biases computed from the input's length, said in words."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for key, refused in LENGTH_BIASES.items():
            value = getattr(config, key, None)
            if (refused is True and value is True) or (isinstance(refused, tuple) and value in refused):
                return f"uses `config.{key}={value!r}` position biases"
    return None
