"""An expert-routing interval as markdown (the TensorBoard card ``diagnostics/routing``), as one console line, as the
layers x experts heatmap (``diagnostics/routing_heatmap``, matplotlib), and as the scalars the troubleshooting view
charts (``routing/<statistic>/<min|p50|p90|max>`` across layers)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diagnostics.analysis.routing import across_layers
from diagnostics.records import RoutingInterval

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STATISTICS = {"max_over_mean": "busiest expert's load over the mean", "cv": "coefficient of variation",
              "entropy": "entropy (1.0: even)"}
"""The per-layer statistics charted across layers, with their chart titles."""


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def verdict_lines(record: RoutingInterval) -> list[str]:
    found = record.verdict
    lines = ["Routing is healthy: no expert collapsed, none dead."] if found.healthy else []
    lines += [f"**Collapse** in `{c.layer}`: expert {c.expert} took {_percent(c.share)} of the assignments."
             for c in found.collapsed]
    lines += [f"**Dead experts** in `{d.layer}`: {', '.join(map(str, d.experts))} got no token." for d in found.dead]
    if found.too_few:
        lines.append(f"Not enough tokens to call an expert dead in {len(found.too_few)} layer(s) (`{found.too_few[0]}`"
                     f"{', ...' if len(found.too_few) > 1 else ''}): each expert was due fewer than 10 assignments;"
                     " use a longer interval (`every_n_steps`).")
    if found.ep_slowdown is not None and found.slowest_ep_rank is not None:
        lines.append(f"Expert parallelism (ep={record.ep}): ep rank {found.slowest_ep_rank} holds the busiest experts;"
                     f" each layer waits for its busiest rank, so expert compute takes {found.ep_slowdown:.2f}x a"
                     " balanced load's time.")
    return lines


def routing_markdown(record: RoutingInterval) -> str:
    lines = [f"### Expert routing, steps {record.first_step}-{record.step}", "", *verdict_lines(record), ""]
    if record.verdict.advice:
        lines += ["What practitioners change:", "", *(f"- {line}" for line in record.verdict.advice), ""]
    ep = record.ep > 1
    lines += ["| layer | tokens | max / mean | CV | entropy | dropped | busiest expert |"
              + (" load per ep rank |" if ep else ""),
              "|---|---:|---:|---:|---:|---:|---|" + ("---|" if ep else "")]
    for name, layer in record.layers.items():
        total = sum(layer.tokens_per_expert)
        busiest = max(range(len(layer.tokens_per_expert)), key=layer.tokens_per_expert.__getitem__)
        dropped = "n/a" if layer.dropped is None else _percent(layer.dropped / total) if total else "0"
        share = _percent(layer.tokens_per_expert[busiest] / total) if total else "-"
        row = (f"| `{name}` | {layer.tokens} | {layer.max_over_mean:.2f} | {layer.cv:.2f} | {layer.entropy:.2f} |"
               f" {dropped} | {busiest} ({share}) |")
        if ep:
            row += f" {' / '.join(map(str, layer.tokens_per_ep_rank or ()))} |"
        lines.append(row)
    if record.counted:
        lines += ["", f"Counted: {record.counted}."]
    return "\n".join(lines)


def routing_summary(record: RoutingInterval) -> str:
    """One console line: the verdict of the interval."""
    head = f"lightning-nd routing, steps {record.first_step}-{record.step}:"
    found = record.verdict
    if found.healthy:
        worst = max((layer.max_over_mean for layer in record.layers.values()), default=0.0)
        return f"{head} healthy (busiest expert {worst:.2f}x the mean)"
    parts = [f"collapse in {c.layer} (expert {c.expert}, {_percent(c.share)})" for c in found.collapsed]
    parts += [f"dead experts {list(d.experts)} in {d.layer}" for d in found.dead]
    return f"{head} {'; '.join(parts)}. HINT: {found.advice[0]}"


def routing_scalars(record: RoutingInterval) -> dict[str, float]:
    layers = list(record.layers.values())
    if not layers:
        return {}
    scalars = {f"routing/{name}/{q}": value for name in STATISTICS
               for q, value in across_layers([getattr(layer, name) for layer in layers]).items()}
    dropped = [layer.dropped / sum(layer.tokens_per_expert) for layer in layers
               if layer.dropped is not None and sum(layer.tokens_per_expert)]
    if dropped:
        scalars["routing/dropped_fraction/max"] = max(dropped)
    if record.verdict.ep_slowdown is not None:
        scalars["routing/ep_slowdown"] = record.verdict.ep_slowdown
    return scalars


def routing_heatmap(record: RoutingInterval) -> Figure:
    """One row per layer, one column per expert: the expert's share of the layer's assignments (an even load is
    1/E everywhere), each cell labelled with its percentage when the grid is small enough to read."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(record.layers)
    experts = max(len(layer.tokens_per_expert) for layer in record.layers.values())
    shares = []
    for layer in record.layers.values():
        total = sum(layer.tokens_per_expert) or 1
        row = [count / total for count in layer.tokens_per_expert]
        shares.append(row + [float("nan")] * (experts - len(row)))
    figure = Figure(figsize=(min(2 + 0.5 * experts, 16), 1.5 + 0.35 * len(names)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
    figure.colorbar(image, ax=axes, label="share", format=lambda value, _: f"{100 * value:.0f}%")
    if experts * len(names) <= 256:
        for row, values in enumerate(shares):
            for column, share in enumerate(values):
                if share == share:  # not NaN
                    axes.text(column, row, f"{100 * share:.0f}", ha="center", va="center", fontsize="x-small",
                              color="white" if share < 0.6 * max(max(values), 1e-9) else "black")
    axes.set_yticks(range(len(names)), names, fontsize="small")
    axes.set_xlabel("expert")
    axes.set_title(f"tokens per expert, steps {record.first_step}-{record.step} (% of each layer)", fontsize="small")
    return figure
