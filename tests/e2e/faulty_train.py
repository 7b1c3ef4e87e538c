"""``examples/train.py`` with faults injected, for the restart tests: run it as the example is run (by torchrun, srun or
Lightning's launcher), with ``FAULTS`` set to a JSON list of faults, each ``{"round": R, "rank": K, "at": A, "step": S}``:
in restart round R (`lightning_nd.runtime.job.restart_round`, e.g. ``"1.0"`` for torchrun's first restart) rank K is
SIGKILLed ``at``:

- ``init``: in ``setup``, after the processes started;
- ``step``: as training step S starts (so S steps are done);
- ``save``: while saving the checkpoint of step S, after its own shards are written and before the save commits
  (every rank's shards and DCP's index are written by then: the rank first copies the folder to
  ``<run dir>/cut-save-<S>``, the state an uninterrupted run had at step S).

Rank 0 also appends every step's logged ``train_loss`` to ``<run dir>/losses.jsonl`` as ``[round, step, loss]``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, Trainer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_nd.checkpoint import files  # noqa: E402
from lightning_nd.runtime.job import restart_round  # noqa: E402


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Faults(Callback):
    def __init__(self, faults: list[dict[str, Any]], losses: Path) -> None:
        here = restart_round()
        self.faults = [f for f in faults if f["round"] == here]
        self.round, self.losses = here, losses

    def _mine(self, trainer: Trainer, at: str, step: int | None = None) -> bool:
        return any(f["at"] == at and f["rank"] == trainer.global_rank and (step is None or f.get("step") == step)
                   for f in self.faults)

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if self._mine(trainer, "init"):
            _die()
        if any(f["at"] == "save" and f["rank"] == trainer.global_rank for f in self.faults):
            written = files.own_files

            def own_files_then_die(folder: Path, rank: int) -> dict:
                found = written(folder, rank)
                if self._mine(trainer, "save", trainer.global_step):
                    shutil.copytree(folder, self.losses.parent / f"cut-save-{trainer.global_step}")
                    _die()
                return found

            files.own_files = own_files_then_die

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._mine(trainer, "step", trainer.global_step):
            _die()

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if trainer.global_rank == 0 and loss is not None:
            with open(self.losses, "a") as handle:
                handle.write(json.dumps([self.round, trainer.global_step, float(loss)]) + "\n")


def main() -> None:
    """The example as its own ``__main__``, every Trainer it makes given the `Faults` callback."""
    from hydra.core.hydra_config import HydraConfig

    faults, make = json.loads(os.environ.get("FAULTS", "[]")), Trainer.__init__

    @functools.wraps(make)  # the example's schema reads the Trainer's signature
    def with_faults(self: Trainer, *args: Any, callbacks: list | None = None, **kwargs: Any) -> None:
        losses = Path(HydraConfig.get().runtime.output_dir) / "losses.jsonl"
        make(self, *args, callbacks=[*(callbacks or []), Faults(faults, losses)], **kwargs)

    Trainer.__init__ = with_faults  # type: ignore[method-assign]
    # Not `runpy`, which sets ``sys.argv[0]`` to the example: Lightning's launcher starts the other ranks with this file.
    script = REPO / "examples" / "train.py"
    exec(compile(script.read_text(), str(script), "exec"), {"__name__": "__main__", "__file__": str(script)})


if __name__ == "__main__":
    main()
