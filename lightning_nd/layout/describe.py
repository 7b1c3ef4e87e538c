"""A `Layout` for people: markdown tables of what each dim splits, the TP style of every module pattern and
its source, the pipeline split, the experts, and what one rank holds. Used by the dry run
(``python -m lightning_nd.plan``) and the TensorBoard layout card, so both say the same.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from lightning_nd.layout.record import Layout, RankHolding
from lightning_nd.mesh.roles import ROLE_MEANING

DIM_MEANING = {
    "pp": "layers into pipeline stages",
    "dp_replicate": "the batch, over full model replicas",
    "dp_shard": "the batch, with parameters/gradients/optimizer state sharded",
    "cp": "the sequence (context)",
    "tp": "every weight matrix",
    "ep": "the MoE experts (ranks borrowed from dp_shard x cp)",
}
KINDS = ("embedding", "attention", "mlp", "experts", "router", "norm", "head", "other")


def pattern(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``model.layers.*.self_attn.q_proj``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} TiB"


def dims_table(layout: Layout) -> list[str]:
    lines = ["| dim | size | splits |", "|---|---|---|"]
    for name, meaning in DIM_MEANING.items():
        lines.append(f"| `{name}` | {layout.dims[name]} | {meaning} |")
    return lines


def roles_table(layout: Layout) -> list[str]:
    lines = ["| role | ranks per group | groups | rank 0's group | what for |", "|---|---|---|---|---|"]
    for role, groups in layout.roles.items():
        mine = next(group for group in groups if 0 in group)
        shown = ", ".join(map(str, mine[:8])) + (", ..." if len(mine) > 8 else "")
        lines.append(f"| `{role}` | {len(mine)} | {len(groups)} | {shown} | {ROLE_MEANING.get(role, '')} |")
    return lines


def tp_table(layout: Layout) -> list[str]:
    if not layout.tp:
        return []
    counts = Counter((pattern(entry.module), entry.style, entry.source) for entry in layout.tp)
    lines = [f"Plan from {layout.tp_source}.", "", "| module | style | source | modules |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {style} | {source} | {count} |" for (name, style, source), count in counts.items()]
    return lines


def pipeline_table(layout: Layout) -> list[str]:
    plan = layout.pipeline
    if plan is None:
        return []
    owner = {stage: rank for rank, stages in enumerate(plan.ranks) for stage in stages}
    lines = [f"Split from {plan.split.source}; schedule {layout.options.pp_schedule},"
             f" {layout.options.pp_microbatches} microbatches.", "", "| stage | pp rank | units |", "|---|---|---|"]
    for index, units in enumerate(plan.split.stages):
        blocks = [u for u in units if u in plan.split.blocks]
        span = f"{blocks[0]}..{blocks[-1]}" if len(blocks) > 1 else blocks[0]
        rest = [u for u in units if u not in plan.split.blocks]
        before = [u for u in rest if u in plan.split.pre]
        after = [u for u in rest if u in plan.split.post]
        lines.append(f"| {index} | {owner[index]} | {' + '.join([*before, span, *after])} |")
    return lines


def experts_table(layout: Layout) -> list[str]:
    if not layout.experts:
        return []
    counts = Counter((pattern(e.module), e.num_experts, e.local_experts, e.sharded_over) for e in layout.experts)
    lines = ["| experts module | experts | per ep rank | sharded over | layers |", "|---|---|---|---|---|"]
    lines += [f"| `{name}` | {total} | {local} | {over or 'none (one rank per expert set)'} | {count} |"
              for (name, total, local, over), count in counts.items()]
    return lines


def holding_table(holding: RankHolding) -> list[str]:
    by_kind = holding.bytes_by_kind()
    counts = Counter(p.kind for p in holding.params)
    numels: Counter[str] = Counter()
    for param in holding.params:
        numels[param.kind] += math.prod(param.local_shape)
    lines = ["| kind | tensors | parameters | bytes |", "|---|---|---|---|"]
    for kind in KINDS:
        if counts[kind]:
            lines.append(f"| {kind} | {counts[kind]} | {numels[kind]:,} | {human_bytes(by_kind[kind])} |")
    lines.append(f"| **total** | {len(holding.params)} | {sum(numels.values()):,} | {human_bytes(holding.param_bytes)}"
                 f" (FSDP storage {human_bytes(holding.padded_param_bytes)}) |")
    return lines


def rank_summary(layout: Layout) -> list[str]:
    """Rank 0 in full; the heaviest rank too when it is another."""
    heaviest = max(layout.ranks, key=lambda holding: holding.param_bytes)
    shown = [layout.ranks[0]] + ([heaviest] if heaviest.rank != 0 and heaviest.param_bytes > layout.ranks[0].param_bytes
                                 else [])
    lines: list[str] = []
    for holding in shown:
        coords = ", ".join(f"{k}={v}" for k, v in holding.coordinates.items())
        stages = f", stages {list(holding.stages)}" if holding.stages else ""
        lines += [f"Rank {holding.rank} ({coords}{stages}) holds:", "", *holding_table(holding), ""]
    smallest = min(layout.ranks, key=lambda holding: holding.param_bytes)
    lines.append(f"Parameter bytes per rank: {human_bytes(smallest.param_bytes)} (rank {smallest.rank}) to"
                 f" {human_bytes(heaviest.param_bytes)} (rank {heaviest.rank}).")
    return lines


def layout_markdown(layout: Layout, applied: list[str] | None = None, rank_table: str | None = None) -> str:
    """The whole Layout as one markdown document; ``applied``: the composer's log lines, when it ran."""
    sections = [("Parallel layout", dims_table(layout)), ("Mesh roles", roles_table(layout)),
                ("Tensor parallel", tp_table(layout)), ("Pipeline stages", pipeline_table(layout)),
                ("Experts", experts_table(layout)),
                ("Applied" if applied is not None else "Techniques, in the order they are applied",
                 [f"- {line}" for line in (applied if applied is not None else
                                           [t.describe() for t in layout.techniques])]),
                ("What one rank holds", rank_summary(layout)),
                ("Warnings", [f"- {warning}" for warning in layout.warnings])]
    if rank_table:
        sections.append(("Rank coordinates", [rank_table]))
    out = []
    for title, lines in sections:
        if lines:
            out += [f"### {title}", "", *lines, ""]
    return "\n".join(out).rstrip() + "\n"
