"""Warnings of Lightning's own internals that a run under `NDParallel` cannot act on, each silenced by its exact
message and the module that raises it, with why. Anything else Lightning or torch says still prints. And our own lines
that every Trainer entry (fit, validate, test, predict) would repeat, said once per process (`first_time`)."""

from __future__ import annotations

import warnings

from lightning.fabric.utilities.warnings import PossibleUserWarning

SILENCED = (
    # Lightning's CombinedLoader flattens every dataloader with `LeafSpec()`, which torch 2.13 deprecates
    # (Lightning-AI/pytorch-lightning#21326, still so in 2.6.6): once per rank at every fit, about Lightning's
    # code, not the user's.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\.utilities\._pytree"),
    # Said whenever `srun` is on the PATH, also outside any SLURM job. The trap it hints at (a multi-process run in
    # a SLURM allocation without srun) is refused with its fix when the Trainer is built (`cluster_checks.py`).
    (r"The `srun` command is available on your system but is not used", PossibleUserWarning,
     r"lightning\.fabric\.plugins\.environments\.slurm"),
)


def silence_internal_warnings() -> None:
    for message, category, module in SILENCED:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


_SAID: set[str] = set()


def first_time(line: str) -> bool:
    """Whether this process says ``line`` for the first time (and from now on, has said it)."""
    if line in _SAID:
        return False
    _SAID.add(line)
    return True
