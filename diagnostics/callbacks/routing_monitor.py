"""`RoutingMonitor`: how each MoE layer's router spreads its tokens over the experts, counted across ranks every
interval of optimizer steps, with collapse and dead experts named and the slow expert-parallel rank priced.

Every training forward, each router's choices are counted on the device (`diagnostics.collect.routers`: the
reference `lightning_nd.nn.moe` layers and transformers' MoE routers; every microbatch and accumulation step, never a
checkpointed block's recomputation). At the end of each interval the ranks' counts meet in one reduction (the
counting rule of `diagnostics.analysis.routing_counts`: ranks seeing different tokens summed, tp copies once, pipeline
stages side by side) and rank 0 writes:

- ``<log_dir>/diagnostics/routing.jsonl``: one `RoutingInterval` a line: ``step``, ``layers`` (router name ->
  ``tokens_per_expert``, ``dropped``, statistics), ``tokens_per_ep_rank`` and the verdict;
- TensorBoard: a histogram of tokens per expert per layer (``routing/<layer>``), the layers x experts heatmap
  (``diagnostics/routing_heatmap``), the card ``diagnostics/routing``, the scalars ``routing/<statistic>/<min|p50|
  p90|max>`` across layers (and ``routing/ep_slowdown`` under ep) charted in the troubleshooting view;
- the console: one line whenever the verdict changes.

The last, partial interval is written when fit ends, and an interval ends at every checkpoint, so a resumed fit keeps
the lines up to its checkpoint's step and appends its own: the lines add up to every assignment of the run. A run
without MoE layers costs nothing: no hook, no collective, no chart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from diagnostics.analysis.routing import LayerLoad, interval
from diagnostics.analysis.routing_counts import Slot, Slots, counts_on_this_tp_rank, dropped_on_this_ep_rank
from diagnostics.callbacks.troubleshooting_view import TroubleshootingView
from diagnostics.collect.routers import Router, attach, find_routers
from diagnostics.records import ROUTING_FILE, RoutingInterval, read_intervals, to_json, write_atomic
from diagnostics.report.routing_card import (
    STATISTICS,
    routing_heatmap,
    routing_markdown,
    routing_scalars,
    routing_summary,
)
from diagnostics.report.tensorboard import log_count_histogram, log_figure, log_text
from lightning_nd.model.batch import token_shape

log = logging.getLogger("lightning_nd")


class RoutingMonitor(Callback):
    def __init__(self, log_dir: str | None = None, every_n_steps: int = 50) -> None:
        """``every_n_steps``: the interval, in optimizer steps (a dead-expert verdict needs each expert due 10
        assignments in one interval: lengthen it for small batches)."""
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"`RoutingMonitor(every_n_steps={every_n_steps!r})` must be an int >= 1. HINT: 50.")
        self._log_dir, self.every = log_dir, every_n_steps
        self.folder: Path | None = None
        self.layout: Any = None
        self.has_routers: bool | None = None
        """From the whole model when the strategy published its Layout; None: found out at train start."""
        self.routers: list[Router] = []
        self.slots = Slots(())
        self.records: list[RoutingInterval] = []
        self._handles: list[Any] = []
        self.active = False
        """Every rank counts and joins each interval's reduction (a rank may hold no router: a dense pipeline stage)."""
        self._closed = self._batch_tokens = 0
        self._batch_tokens_known = True
        self._warned: set[str] = set()
        self.source: str | None = None
        """Whose MoE layers (the advice's keys), from the whole model: under pp rank 0 may hold no router."""

    # ---- set-up --------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.folder = Path(self._log_dir or trainer.default_root_dir) / "diagnostics"

    def on_nd_layout_ready(self, strategy: Any, event: Any) -> None:
        self.layout = event.layout
        whole = find_routers(strategy.lightning_module)
        self.has_routers, self.source = bool(whole), _source(whole)
        view = TroubleshootingView.of(strategy.lightning_module.trainer)
        if view is None or not self.has_routers:
            return
        for name, title in STATISTICS.items():
            view.multiline("routing", f"{title}, across layers", [rf"routing/{name}/.*"])
        view.multiline("routing", "dropped fraction, worst layer", ["routing/dropped_fraction/max"])
        if event.layout.dims.get("ep", 1) > 1:
            view.multiline("routing", "expert compute under ep over a balanced load", ["routing/ep_slowdown"])

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._detach()
        self.active, self.records, self._closed = False, [], trainer.global_step
        self._batch_tokens, self._batch_tokens_known = 0, True
        if self.has_routers is False:
            return
        pipeline = getattr(self.layout, "pipeline", None)
        self.routers = find_routers(pl_module, pipeline.attribute if pipeline is not None else None)
        mine = [Slot(router.name, router.experts, router.top_k, router.reports_dropped) for router in self.routers]
        everyone: list[Any] = [mine]
        if dist.is_initialized():  # once per fit: which routers each rank holds (pipeline stages differ)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        self.slots = Slots.of(everyone)
        if not self.slots.slots:
            return
        self.active, self._handles = True, attach(self.routers)
        if trainer.global_rank == 0:
            self._start_file(trainer.global_step)

    def _start_file(self, step: int) -> None:
        """A fresh fit starts the file again; a resumed one keeps the intervals up to its checkpoint's step."""
        path = self.folder / ROUTING_FILE
        if step == 0 or not path.exists():
            path.unlink(missing_ok=True)
            return
        kept = [to_json(r, indent=None) for r in read_intervals(path.read_text()) if r.step <= step]
        write_atomic(path, "".join(line + "\n" for line in kept))

    # ---- every step ----------------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        shape = token_shape(batch)
        if shape is None:
            self._batch_tokens_known = False
        else:
            self._batch_tokens += shape[0] * shape[1]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            self._close(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._close(trainer, pl_module)  # every rank saves: the counts so far belong to the checkpoint's steps

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close(trainer, pl_module)
        self._detach()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()  # no collective: the other ranks may be gone; the interval in progress is lost

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._detach()

    def _detach(self) -> None:
        self.active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- the interval --------------------------------------------------------------------------------------

    def _close(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if not self.active or step <= self._closed:
            return
        first, self._closed = self._closed + 1, step
        summed = self._reduce(trainer, pl_module)
        self._batch_tokens, self._batch_tokens_known = 0, True
        if trainer.global_rank != 0:
            return
        try:
            self._report(trainer, first, step, self.slots.unpack(summed))
        except Exception as error:  # noqa: BLE001 - a diagnostic never stops the run
            log.warning("lightning-nd RoutingMonitor: interval ending at step %d not reported: %s", step, error)

    def _reduce(self, trainer: Trainer, pl_module: LightningModule) -> list[int]:
        """This rank's counts by the counting rule, summed over every rank on rank 0: the interval's one collective."""
        dims = getattr(self.layout, "dims", {}) or {}
        tp, sequence_parallel = dims.get("tp", 1), bool(getattr(getattr(self.layout, "options", None),
                                                                "sequence_parallel", False))
        tp_rank = next((group.index(trainer.global_rank) for group in self.layout.roles.get("tp", [])
                        if trainer.global_rank in group), 0) if self.layout is not None else 0
        batch_tokens = self._batch_tokens if self._batch_tokens_known else None
        mine: dict[str, tuple[list[int], int, int]] = {}
        for router in self.routers:
            if router.unreadable and router.name not in self._warned:
                self._warned.add(router.name)
                log.warning("lightning-nd RoutingMonitor: `%s` (%s) is not counted: %s.", router.name,
                            type(router.module).__name__, router.unreadable)
            counts, tokens, dropped = router.take()
            if not counts_on_this_tp_rank(tp_rank, tp, sequence_parallel, tokens, batch_tokens):
                continue
            group = getattr(getattr(router.block, "experts", None), "group", None)
            ep_rank = dist.get_rank(group) if group is not None else None
            mine[router.name] = (counts, tokens, dropped if dropped_on_this_ep_rank(ep_rank) else 0)
        vector = torch.tensor(self.slots.pack(mine), dtype=torch.int64, device=pl_module.device)
        if dist.is_initialized():
            dist.reduce(vector, dst=0)
        return vector.tolist()

    def _counted(self) -> str:
        dims = getattr(self.layout, "dims", None)
        if not dims:
            return "summed over every rank"
        parts = [f"summed over the {dims['dp_replicate'] * dims['dp_shard'] * dims['cp']} ranks that see different"
                 f" tokens (dp_replicate x dp_shard x cp)"]
        if dims.get("tp", 1) > 1:
            parts.append(f"each tp group's copies once (tp={dims['tp']}; with sequence parallelism each tp rank's"
                         " share of the sequence)")
        if dims.get("pp", 1) > 1:
            parts.append(f"the layers of the {dims['pp']} pipeline stages side by side")
        return "; ".join(parts)

    def _report(self, trainer: Trainer, first: int, step: int, summed: dict[str, tuple[list[int], int, int | None]]
                ) -> None:
        slots = self.slots.slots_by_name
        layers = [LayerLoad(name, tuple(counts), slots[name].top_k, dropped)
                  for name, (counts, _, dropped) in summed.items()]
        ep = getattr(self.layout, "dims", {}).get("ep", 1) if self.layout is not None else 1
        # The Layout's expert placement: the routers beside an experts module that ep splits, or its block where the
        # block routes itself (a gate linear, the top-k in the block's forward).
        split = {placement.module.rpartition(".")[0] for placement in getattr(self.layout, "experts", ())}
        ep_layers = {name for name in summed if name in split or name.rpartition(".")[0] in split}
        record = interval(first, step, layers, ep, self.source or _source(self.routers), self._counted(),
                          ep_layers)
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ROUTING_FILE, "a") as out:
            out.write(to_json(record, indent=None) + "\n")
        for logger in trainer.loggers:
            logger.log_metrics(routing_scalars(record), step=step)
        for name, layer in record.layers.items():
            log_count_histogram(trainer, f"routing/{name}", layer.tokens_per_expert)
        log_text(trainer, "diagnostics/routing", routing_markdown(record))
        log_figure(trainer, "diagnostics/routing_heatmap", routing_heatmap(record))
        if not self.records or _named(self.records[-1]) != _named(record):
            print(routing_summary(record), flush=True)
        self.records.append(record)


def _named(record: RoutingInterval) -> tuple:
    """What the verdict names: the console line is printed again only when it changes."""
    found = record.verdict
    return tuple((c.layer, c.expert) for c in found.collapsed), tuple((d.layer, d.experts) for d in found.dead)


def _source(routers: list[Router]) -> str:
    transformers = any(type(r.module).__module__.startswith("transformers.") for r in routers)
    return "hugging_face" if transformers else "reference"
