"""Zero-filled inputs for the trial forward torch's pipelining runs to learn each stage's shapes, marked as a trial.

Before the first step, torch runs every stage once on inputs made from the previous stage's metadata.
torch 2.13 makes them with ``torch.empty_strided``: uninitialised memory, so the tp ranks of one stage
run it on different values. Anything that depends on the values and must agree across tp ranks then
fails: experts split over tp route by the input and check that their tp ranks routed alike
(`tensor_parallel/apply/experts.py`), and a capacity limit would make their all-reduces differ in size. Earlier
torch releases filled these inputs with zeros; this puts that back. Only the trial's own inputs change:
real tensors (the first stage's batch) pass through as torch hands them over. The trial runs inside
`lightning_nd.runtime.trial.trial_forward`, so what counts training forwards (MoE routing) leaves it out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from lightning_nd.runtime.trial import as_trial

TRIAL_METHODS = ("_forward_metadata_inference", "_shape_inference")
"""The stage's method that runs the trial forward, by torch release (the first one found is marked)."""


def zero_trial_inputs(stage: PipelineStage) -> None:
    """Make ``stage``'s metadata-inference inputs zeros (no-op on a torch whose stage lacks ``_to_tensor``), and run
    its trial forward as one (`lightning_nd.runtime.trial`)."""
    method = next((name for name in TRIAL_METHODS if hasattr(stage, name)), None)
    if method is not None:
        setattr(stage, method, as_trial(getattr(stage, method)))
    to_tensor: Callable[[Any], torch.Tensor] | None = getattr(stage, "_to_tensor", None)
    if to_tensor is None:
        return

    def zeroed(arg: Any) -> torch.Tensor:
        tensor = to_tensor(arg)
        if not isinstance(arg, torch.Tensor):
            with torch.no_grad():
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).zero_()
        return tensor

    stage._to_tensor = zeroed  # type: ignore[method-assign]
