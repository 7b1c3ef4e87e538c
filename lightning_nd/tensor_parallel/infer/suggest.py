"""The refusal of a model no plan splits: its linear layers listed, and a plan to copy (a layer that fans out of
the residual stream colwise, the one that comes back rowwise)."""

from __future__ import annotations

from torch import nn

from lightning_nd.model.structure import find_blocks, linear_names


def no_plan_message(model: nn.Module, tp: int, declared: bool, known: tuple[str, ...]) -> str:
    """``known``: a few of the layer names the name patterns split."""
    linears = linear_names(model)
    if declared:
        return (f"`NDParallel(tp={tp})`: the plan `{type(model).__name__}` declares (`base_model_tp_plan`) splits no"
                f" weight matrix, only embeddings or norms. HINT: pass `NDParallel(tp_plan=...)` naming its"
                f" attention and MLP layers ('colwise' in, 'rowwise' out), e.g. {_suggest_plan(model)}.")
    suggestion = _suggest_plan(model)
    listing = "\n".join(f"    {name}" for name in linears) or "    (none)"
    return (
        f"`NDParallel(tp={tp})` found no tensor-parallel plan for `{type(model).__name__}`: it declares none"
        f" (`_tp_plan`), none of its linear layers has a known name ({', '.join(known)}, ...),"
        " and its blocks' structure shows no attention split by heads and no feed-forward pair (a layer fanning out"
        " of the residual width, then one coming back, in that order)."
        f"\n  Linear layers:\n{listing}\n"
        f"  HINT: pass a plan, e.g. `NDParallel(tp={tp}, tp_plan={suggestion})`: 'colwise' for a layer that"
        " fans out of the residual stream, 'rowwise' for the one that comes back into it."
    )


def _suggest_plan(model: nn.Module) -> dict[str, str]:
    blocks = find_blocks(model)
    if not blocks:
        return {name: "colwise" for name in linear_names(model)[:1]}
    first_name, first = blocks[0]
    pattern_prefix = first_name.rsplit(".", 1)[0] + ".*." if "." in first_name else "*."
    plan = {}
    for name, module in first.named_modules():
        if isinstance(module, nn.Linear):
            fans_out = module.out_features >= module.in_features
            plan[pattern_prefix + name] = "colwise" if fans_out else "rowwise"
    return plan
