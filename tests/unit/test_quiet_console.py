"""`NDParallel` silences two warnings of Lightning's internals by their exact message and module
(`lightning_nd/strategy/quiet.py`), raised here by the Lightning code that says them: the same message from
anywhere else still prints. The README's main job checks the console as a whole (tests/e2e/test_main_job.py)."""

from __future__ import annotations

import warnings

from lightning.fabric.plugins.environments import slurm
from lightning.pytorch.utilities._pytree import _tree_flatten
from lightning_utilities.core.rank_zero import rank_zero_only

from lightning_nd.strategy.quiet import silence_internal_warnings


def test_lightnings_internal_warnings_are_silenced_and_the_same_words_elsewhere_are_not(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")  # srun installed, not used
    monkeypatch.delenv("SLURM_NTASKS", raising=False)  # not in a task srun started
    monkeypatch.setattr(rank_zero_only, "rank", 0)  # Lightning says it on rank 0; an earlier test may have set another
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _tree_flatten([1, 2])  # CombinedLoader's flattening of a dataloader: `LeafSpec()`
        slurm.SLURMEnvironment._validate_srun_used()
        loud = len(said)
        silence_internal_warnings()
        _tree_flatten([1, 2])
        slurm.SLURMEnvironment._validate_srun_used()
        for warning in said[:loud]:
            warnings.warn(str(warning.message), warning.category, stacklevel=1)  # from this module
    assert loud == 2, [str(w.message) for w in said]
    assert [(w.category, w.filename) for w in said[loud:]] == [(w.category, __file__) for w in said[:loud]]
