"""What the benchmarks share: the Llama-style model they time, a LightningModule that does only the step,
a step timer, and the model-state bytes a rank holds."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

MODEL_CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4)


def build_model() -> nn.Module:
    """The 6.4M-parameter Llama-style model of the timing benchmarks, the same weights on every rank."""
    from examples.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**MODEL_CONFIG))


def build_moe_model() -> nn.Module:
    """The same model with every MLP made of 8 experts, top-2 (`lightning_nd.nn.moe.MoE`)."""
    from examples.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(**MODEL_CONFIG, num_experts=8))


def state_bytes(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Parameters, gradients and optimizer moments this rank holds (local shards; 0-dim step counters left out)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    state = parameters + [p.grad for p in parameters]
    state += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(local(t).numel() * t.element_size() for t in state if t is not None and t.ndim > 0)


class Bench(LightningModule):
    """Cross-entropy on (tokens, labels) batches, AdamW; no logging, no metrics.

    ``build`` makes the model: at construction, or in `configure_model` with ``in_configure_model``
    (meta-device init under NDParallel). ``configure`` is a user's own parallel code for that hook.
    """

    def __init__(self, build: Callable[[], nn.Module], *, in_configure_model: bool = False,
                 configure: Callable[[nn.Module, object], None] | None = None) -> None:
        super().__init__()
        self.build, self.configure = build, configure
        self.model = None if in_configure_model else build()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.build()
        if self.configure is not None:
            self.configure(self.model, self.device_mesh)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return F.cross_entropy(self.model(tokens).flatten(0, 1).float(), labels.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(Callback):
    """Wall time between the starts of consecutive steps (everything the loop does), after warm-up; and the
    process's CPU time over the same spans (every thread of it: less disturbed than wall time by other processes
    on a shared host, which delay a step without adding to its CPU time)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])][self.warmup:]

    @property
    def cpu_step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.cpu_starts, self.cpu_starts[1:])][self.warmup:]


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in a (nested) list or tuple, as collectives receive them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


class StepTracker(MemTracker):
    """`MemTracker` that lets a top-level module run forward several times in one step (a pipeline stage runs once
    per microbatch): its per-module statistics restart, the peak over the step is kept."""

    def _pre_fw_hook(self, module, inputs) -> None:
        parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
        if module in self.memory_tracking and not self._mod_tracker.is_bw and parents <= {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


class PeakMemory(Callback):
    """The peak of one training step (``step``: its batch index) as torch's `MemTracker` counts it, on this rank:
    ``peak_bytes`` and ``by_kind`` (Parameter, Gradient, Optstate, Activation, Temp, ... at that peak)."""

    def __init__(self, step: int = 1) -> None:
        self.step, self.tracker = step, None
        self.peak_bytes, self.by_kind = 0, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.step:
            self.tracker = StepTracker()
            self.tracker.track_external(pl_module, *trainer.optimizers)
            self.tracker.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.step and self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            (snapshot,) = self.tracker.get_tracker_snapshot("peak").values()
            self.by_kind = {kind: value for kind, value in snapshot.items() if value}
            self.peak_bytes = snapshot["Total"]

