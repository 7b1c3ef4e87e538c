"""The planner without a model (``--params N``): model state per rank for each way to split N parameters.

Without the model's shape there are no activations, no head or layer counts to check, and no step time:
each rank's share is N / (tp x pp), sharded over dp_shard by FSDP and replicated over dp_replicate (HSDP)
(fp32 parameters and gradients, the optimizer's fp32 states), beside the ZeRO paper's 2 + 2 + 12 bytes per
parameter sharded the same way. Only the replicas change a rank's model state; the layouts differ in what the
model (``--model``) would add: activations and communication.
"""

from __future__ import annotations

from lightning_nd.cost.model_state import OPTIMIZER_STATES, ZERO_PAPER_K
from lightning_nd.layout.describe import human_bytes
from lightning_nd.mesh.dims import divisors
from lightning_nd.planner.search import describe_sizes


def params_only_rows(params: int, devices: int, gpus_per_node: int, optimizer: str) -> list[dict]:
    """One row per (tp inside a node, pp, dp_replicate up to the node count): the model state of one rank."""
    rows = []
    nodes = devices // gpus_per_node
    for tp in divisors(gpus_per_node):
        if devices % tp:
            continue
        for pp in divisors(devices // tp):
            for replicate in (r for r in divisors(devices // (tp * pp)) if r <= nodes):
                fsdp = devices // (tp * pp * replicate)
                share = params / (tp * pp)
                state = share * (4 + 4 + 4 * OPTIMIZER_STATES[optimizer]) / fsdp
                rows.append({"sizes": {"pp": pp, "dp_replicate": replicate, "dp_shard": fsdp, "tp": tp},
                             "model_state_bytes": int(state), "paper_bytes": int((4 + ZERO_PAPER_K) * share / fsdp),
                             "params_per_rank": share / fsdp})
    return sorted(rows, key=lambda row: (row["model_state_bytes"], row["sizes"]["tp"] * row["sizes"]["pp"]))


def params_only_markdown(params: int, devices: int, gpus_per_node: int, memory_bytes: int,
                         optimizer: str) -> tuple[str, bool]:
    """The table, and whether any layout's model state fits."""
    lines = [f"# Planner, model state only: {params / 1e9:.2f}B parameters on {devices} GPUs of"
             f" {human_bytes(memory_bytes)} ({optimizer}, zero_stage=3)", "",
             "Without a model there are no activations: \"fits\" is judged on model state alone and says nothing of"
             " the activations a batch adds. Give the model (`--model`, `--hf-model-type`) for the full plan.", "",
             "| layout | parameters per rank | model state (FSDP2 here) | ZeRO paper (2+2+12 B) | model state fits |",
             "|---|---|---|---|---|"]
    rows = params_only_rows(params, devices, gpus_per_node, optimizer)
    for row in rows:
        fits = "yes" if row["model_state_bytes"] <= memory_bytes else "no"
        lines.append(f"| `{describe_sizes(row['sizes'])}` | {row['params_per_rank'] / 1e9:.3f}B |"
                     f" {human_bytes(row['model_state_bytes'])} | {human_bytes(row['paper_bytes'])} | {fits} |")
    return "\n".join(lines), any(row["model_state_bytes"] <= memory_bytes for row in rows)
