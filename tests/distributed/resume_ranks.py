"""Resuming from what a run finds on disk, on every rank (`test_auto_resume.py`): ``ckpt_path="auto"`` with nothing
to find, with the newest checkpoint damaged (same size, other bytes: it looks whole until its checksums are read), and
a checkpoint of a model of another vocabulary, refused before any step."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.data import TokenDataModule
from examples.lit import CausalLM
from examples.models.llama import Llama, LlamaConfig
from lightning_nd import NDParallel
from lightning_nd.checkpoint import CheckpointMismatch
from tests.distributed.checkpoint_ranks import GLOBAL_BATCH, SEQ_LEN, STEPS_PER_EPOCH, StateAt
from tests.distributed.parity_ranks import LossRecorder
from tests.models import VOCAB, build


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Batches(Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.started += 1


def _fit(root: Path, steps: int, model: Any, ckpt_path: str | None, save: bool) -> dict[str, Any]:
    said, batches, recorder, state = Said(), Batches(), LossRecorder(), StateAt()
    logging.getLogger("lightning_nd").addHandler(said)
    logging.getLogger("lightning_nd").setLevel(logging.INFO)  # as the strategy sets it on rank 0 without a handler
    checkpoints = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")]
    trainer = Trainer(strategy=NDParallel(dp_shard=2), accelerator="cpu", devices=2, max_steps=steps,
                      default_root_dir=root, callbacks=[recorder, state, batches, *(checkpoints if save else [])],
                      logger=False, enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0)
    data = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * STEPS_PER_EPOCH,
                           batch_size=GLOBAL_BATCH // 2)
    result: dict[str, Any] = {}
    try:
        trainer.fit(CausalLM(model=model, lr=1e-3), datamodule=data, ckpt_path=ckpt_path)
    except CheckpointMismatch as error:
        result["refused"] = str(error)
    finally:
        logging.getLogger("lightning_nd").removeHandler(said)
    return {**result, "said": said.lines, "batches": batches.started, "losses": recorder.losses,
            "loaded": state.loaded, "step": trainer.global_step}


def _out_of_memory_on_rank1(folder: Path) -> dict[str, Any]:
    """Reading the newest checkpoint's random state runs out of memory on rank 1 alone: every rank is told, and the
    one before is loaded (before, only a `CheckpointError` was shared and rank 0 waited in DCP's collectives)."""
    from lightning_nd.checkpoint import state_files

    if dist.get_rank() == 0:
        shutil.copytree(folder / "run", folder / "memory")
    dist.barrier()
    real = state_files.read_json

    def read_json(file: Path, limit: int) -> Any:
        if dist.get_rank() == 1 and file.name == "rng-1.json" and file.parent.name == "step=6.ckpt":
            raise MemoryError("cannot allocate 17179869184 bytes")
        return real(file, limit)

    state_files.read_json = read_json
    try:
        return _fit(folder / "memory", 8, build("llama", seed=1), "auto", save=True)
    finally:
        state_files.read_json = real


def scenarios(root: str) -> dict[str, Any]:
    folder = Path(root)
    results = {"fresh": _fit(folder / "run", 6, build("llama"), "auto", save=True)}  # saves steps 3 and 6
    shard = sorted((folder / "run" / "ckpt" / "step=6.ckpt").glob("__0_*.distcp"))[0].name
    damaged = folder / "damaged" / "ckpt" / "step=6.ckpt" / shard
    if dist.get_rank() == 0:  # step 6 damaged in a copy: same sizes, other bytes
        shutil.copytree(folder / "run", folder / "damaged")
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
    dist.barrier()
    before = damaged.read_bytes()
    results["damaged"] = _fit(folder / "damaged", 8, build("llama", seed=1), "auto", save=True)
    results["damaged"]["kept"] = damaged.read_bytes() == before
    results["one_rank_out_of_memory"] = _out_of_memory_on_rank1(folder)
    results["reference"] = _fit(folder / "reference", 8, build("llama", seed=1),
                                str(folder / "run" / "ckpt" / "step=3.ckpt"), save=False)
    wide = Llama(LlamaConfig(vocab_size=2 * VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4))
    results["other_vocabulary"] = _fit(folder / "run", 8, wide, str(folder / "run" / "ckpt" / "step=6.ckpt"), save=False)
    return results
