"""Run on each of 2 ranks: every given transformers family's tiny model under tp=2 against the same model in one
process (tests/distributed/test_hf_families.py): logits and every parameter's gradient, float64, real gloo collectives.

Each family is planned with `plan_layout`, applied with `apply_tp` on a real tp mesh and run once; the reference is
a copy of the same seeded model run whole. A family whose plan is refused, or whose tiny model does not run in one
process, is reported as such with its reason; a family whose tp run raises or differs is reported with the error.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch
import torch.distributed as dist

VOCAB, BATCH, SEQ = 128, 2, 8
TOLERANCE = 1e-6
"""Largest error relative to the tensor's largest value (logits and every gradient): float64 runs differ by 1e-15,
those that compute a norm in float32 inside (Gemma 3) by 1e-7; a wrong split by 1e-2 or more."""


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=ids, use_cache=False)[0]
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits, logits.float().square().mean()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return grads


def check_family(model_type: str, mesh, sequence_parallel: bool = False) -> tuple[str, str, float]:
    from lightning_nd import ParallelConfig, ParallelDims, plan_layout
    from lightning_nd.expert_parallel.dispatch import apply_ep
    from lightning_nd.tensor_parallel.apply.model import apply_tp
    from lightning_nd.tensor_parallel.infer.hugging_face import TPPlanRefusal
    from tests.hf_tiny import tiny_model

    torch.manual_seed(0)
    try:
        # float64: a wrong split shows as an error of 1e-3 or more, float32's rounding (1e-4 here) would blur it;
        # eval: no dropout, whose masks the two runs would draw differently
        model = tiny_model(model_type).double().eval()
        with torch.no_grad():  # zero-initialised gates and scales (Doge's `A`, NeoMME's `alpha`) would hide the
            for param in model.parameters():  # gradients of what they gate
                if not param.count_nonzero():
                    param.normal_(0.0, 0.1)
        reference = copy.deepcopy(model)
        ids = torch.randint(3, VOCAB, (BATCH, SEQ))
        logits, loss = _loss(reference, ids)
        loss.backward()
    except Exception as error:  # noqa: BLE001  (the family itself, in one process)
        return "not runnable", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}", 0.0
    try:
        layout = plan_layout(model, ParallelDims(tp=2, world_size=2), ParallelConfig(sequence_parallel=sequence_parallel))
    except TPPlanRefusal as refusal:
        return "refused", ", ".join(sorted(refusal.pieces)), 0.0
    except ValueError as error:
        return "refused", str(error).split(" HINT")[0][:200], 0.0
    try:
        apply_tp(model, mesh, {entry.module: entry.style for entry in layout.tp}, sequence_parallel=sequence_parallel,
                 loss_parallel=False, block_names=list(layout.blocks))
        if layout.applies("expert_tensor_parallel"):
            apply_ep(model, None, mesh)
        tp_logits, tp_loss = _loss(model, ids)
        tp_loss.backward()
    except Exception as error:  # noqa: BLE001  (reported: a plan that does not run is a failure)
        return "failed", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}", 0.0
    expected, got = _grads(reference), _grads(model)
    worst = (logits - tp_logits).abs().max().item()
    missing = sorted(set(expected) ^ set(got))
    if missing:
        return "failed", f"gradients only on one side: {missing[:3]}", worst
    errors = {"logits": worst / max(logits.abs().max().item(), 1e-6)}
    for name, grad in expected.items():
        errors[f"{name}.grad"] = (grad - got[name]).abs().max().item() / max(grad.abs().max().item(), 1e-6)
    wrong = sorted((name for name, error in errors.items() if error > TOLERANCE), key=errors.__getitem__, reverse=True)
    styles = "styles: " + ", ".join(sorted({entry.style for entry in layout.tp}))
    detail = f"{len(wrong)} of {len(errors)} tensors differ, e.g. {', '.join(wrong[:3])}" if wrong else styles
    return ("differs" if wrong else "planned"), detail, max(errors.values())


def run(families: list[str], sequence_parallel: tuple[str, ...] = ()) -> dict[str, tuple[str, str, float]]:
    """Every family at tp=2; those in ``sequence_parallel`` also with sequence parallelism (keyed ``name+sp``)."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results = {family: check_family(family, mesh) for family in families}
    results.update({f"{family}+sp": check_family(family, mesh, sequence_parallel=True) for family in sequence_parallel})
    dist.destroy_process_group()
    return results
