"""Checkpoints: resume on the same layout continues the loss curve bit for bit (mid-epoch in epochs 0 and 1,
so the data position and the sampler's epoch matter); resharded to other layouts (dp, tp, pp x dp, cp x dp, experts over other ep or split over tp) the
loaded parameters are the saved ones and the next step's loss matches (HSDP too); a one-file export loads into
other layouts, into one process (the same outputs as the folder) and into a plain Lightning run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from examples.data import TokenDataModule
from examples.lit import CausalLM, logits_of
from lightning_nd.checkpoint import export, latest_checkpoint, read_sharded
from tests.distributed.checkpoint_ranks import GLOBAL_BATCH, SAVE_EVERY, SEQ_LEN, STEPS, probe_tokens
from tests.launcher import REPO, launch
from tests.models import VOCAB, build

DENSE = {
    "dp4": {"dp_shard": 4}, "tp4": {"dp_shard": 1, "tp": 4}, "pp2_dp2": {"pp": 2, "dp_shard": 2},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
    "cp2_dp2": {"cp": 2, "dp_shard": 2}, "full_pp2_tp2": {"pp": 2, "dp_shard": 1, "tp": 2},
    "full_dp2_tp2_sp": {"dp_shard": 2, "tp": 2, "sequence_parallel": True},
}
MOE = {"ep2_dp4": {"dp_shard": 4, "ep": 2}, "dp4": {"dp_shard": 4}, "full_ep4_dp4": {"dp_shard": 4, "ep": 4},
       "etp_dp2_tp2": {"dp_shard": 2, "tp": 2},  # every expert split over tp (expert tensor parallelism)
       "etp_ep2_tp2": {"dp_shard": 2, "ep": 2, "tp": 2}}  # split both ways
# The MoE launch's layers weigh their auxiliary losses 0: the step's loss (which `CausalLM` adds them to) is then
# the same under every layout; with ep the load-balancing loss reads the ep group's counts (`nn/moe.py`), so its
# value, not the weights resumed, depends on the layout.
LITGPT = {"pp2_dp2": {"pp": 2, "dp_shard": 2}, "full_dp4": {"dp_shard": 4}}
LAUNCHES = {"dense": ("llama", {"dp_shard": 2, "tp": 2}, DENSE),
            "moe": ("moe_llama_no_aux", {"dp_shard": 4, "ep": 4}, MOE),
            "litgpt": ("litgpt:llama3", {"dp_shard": 2, "tp": 2}, LITGPT)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    done = {}

    def run(name: str):
        if name not in done:
            model, base, layouts = LAUNCHES[name]
            root = tmp_path_factory.mktemp(f"ckpt_{name}")
            results = launch("tests.distributed.checkpoint_ranks:resume_and_reshard", 4, root / "out", timeout=900,
                             ckpt_dir=str(root / "ckpt"), base=base, layouts=layouts, export_to=str(root / "full.ckpt"),
                             model=model)
            done[name] = (root, results)
        return done[name]

    return run


def _merged(results: list, run: str, what: str) -> dict[str, torch.Tensor]:
    """Whole parameters by name over ranks (a pipeline rank holds its stages' only)."""
    merged: dict[str, torch.Tensor] = {}
    for rank_result in results:
        merged.update(rank_result[run][what])
    return merged


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_resume_on_the_same_layout_continues_the_loss_curve_exactly(runs, name):
    _, results = runs(name)
    uninterrupted = results[0]["uninterrupted"]
    assert len(uninterrupted["losses"]) == STEPS
    for run, start in (("same_layout", SAVE_EVERY), ("same_layout_epoch1", 2 * SAVE_EVERY)):
        resumed = results[0][run]
        assert resumed["losses"] == uninterrupted["losses"][start:], run  # bit for bit: weights, Adam, RNG, data
        assert resumed["epoch"] == uninterrupted["epoch"] and resumed["step"] == STEPS
        for rank_result in results:  # each rank's random stream continues where it was saved
            draws = rank_result["uninterrupted"]["draws"]
            assert rank_result[run]["draws"] == {step: draws[step] for step in range(start + 1, STEPS + 1)}


@pytest.mark.parametrize("name,layout", [(n, layout) for n, (_, _, layouts) in LAUNCHES.items() for layout in layouts])
def test_resharded_resume_loads_the_saved_weights_and_matches_the_next_step(runs, name, layout):
    _, results = runs(name)
    saved, loaded = _merged(results, "uninterrupted", "after"), _merged(results, layout, "loaded")
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    expected = results[0]["uninterrupted"]["losses"][SAVE_EVERY]
    torch.testing.assert_close(results[0][layout]["losses"], [expected], rtol=1e-6, atol=2e-6)


def test_export_cli_loads_into_one_process_with_the_same_outputs_and_resumes_there(runs, tmp_path):
    root, results = runs("dense")
    step3 = root / "ckpt" / f"step={SAVE_EVERY}.ckpt"
    for out, extra in ((tmp_path / "full.ckpt", []), (tmp_path / "model.safetensors", ["--module", "model"])):
        done = subprocess.run([sys.executable, "-m", "lightning_nd.checkpoint", "export", str(step3), str(out), *extra],
                              cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "Checking" in done.stderr and "Writing" in done.stderr  # progress shown
    truncated = tmp_path / "truncated.ckpt"
    shutil.copytree(step3, truncated)
    shard = truncated / "__2_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    one = launch("tests.distributed.checkpoint_ranks:one_process", 1, tmp_path / "out", timeout=300,
                 sharded=str(step3), full=str(tmp_path / "full.ckpt"), truncated=str(truncated))[0]
    assert torch.equal(one["sharded"], one["full"])
    expected = results[0]["uninterrupted"]["losses"][SAVE_EVERY]
    torch.testing.assert_close(one["resumed"]["losses"], [expected], rtol=1e-6, atol=2e-6)
    assert "`__2_0.distcp` (written by rank 2) has 100 bytes" in one["truncated_error"]

    from safetensors.torch import load_file

    plain = build("llama", seed=5)
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(logits_of(plain(probe_tokens())), one["sharded"], rtol=0, atol=0)
    saved = _merged(results, "uninterrupted", "after")
    for key, value in torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"].items():
        assert torch.equal(value, saved[key.removeprefix("model.")]), key


@pytest.mark.parametrize("saved_under", ["dp2_tp2", "pp2_dp2"])
def test_export_resumes_plain_torch_with_its_optimizer_state(runs, tmp_path, saved_under):
    """The export is an ordinary Lightning checkpoint (`torch.optim` state by position, in the whole model's
    parameter order even when saved by pipeline stages): loaded into one plain module and optimizer, the
    next steps (the second depends on Adam's moments) match the uninterrupted run."""
    root, results = runs("dense")
    if saved_under == "dp2_tp2":  # saved after step 3
        full, first_step = torch.load(root / "full.ckpt", weights_only=False), SAVE_EVERY
    else:  # saved by the pp=2 x dp_shard=2 run after it resumed and trained step 4
        export(root / "ckpt" / "pp2_dp2.ckpt", tmp_path / "pp.ckpt", progress=lambda _: None)
        full, first_step = torch.load(tmp_path / "pp.ckpt", weights_only=False), SAVE_EVERY + 1
    module = CausalLM(model=build("llama", seed=9), lr=1e-3)
    assert full["lightning_nd"]["param_names"][0][0] == [name for name, _ in module.named_parameters()]
    module.load_state_dict(full["state_dict"])
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(full["optimizer_states"][0])
    dataset = TokenDataModule(vocab_size=VOCAB, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * 4).train_dataloader().dataset
    # DistributedSampler (seed 0): step i of epoch e takes positions [8i, 8i + 8) of randperm(32, seed e).
    orders = [torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in (0, 1)]
    steps = [orders[0][24:32], orders[1][0:8], orders[1][8:16]][first_step - SAVE_EVERY:][:2]
    losses = []
    for order in steps:
        batch = torch.utils.data.default_collate([dataset[i] for i in order])
        optimizer.zero_grad()
        loss = module.loss(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    expected = results[0]["uninterrupted"]["losses"][first_step:first_step + 2]
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=2e-6)


def test_latest_complete_checkpoint_and_its_contents(runs):
    root, _ = runs("dense")
    latest = latest_checkpoint(root / "ckpt")  # the pipeline run saved last, after resuming at step 3
    assert latest is not None and latest.name == "pp2_dp2.ckpt"
    whole = read_sharded(latest)
    assert whole["global_step"] == SAVE_EVERY + 1 and whole["lightning_nd"]["layout"]["pp"] == 2
    assert read_sharded(root / "ckpt" / f"step={2 * SAVE_EVERY}.ckpt")["lightning_nd"]["layout"]["tp"] == 2
    names = whole["lightning_nd"]["param_names"][0][0]
    assert len(whole["optimizer_states"][0]["state"]) == len(names) == len(whole["state_dict"])


def test_a_litgpt_export_loads_into_a_plain_gpt_under_litgpts_own_names(runs, tmp_path):
    """Saved by LitGPT's `GPT` under dp_shard x tp (its attention split by heads): the one-file export of the model
    has exactly the keys a plain `GPT` writes, loads into one strictly, and holds the weights saved at that step."""
    root, results = runs("litgpt")
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "lightning_nd.checkpoint", "export",
                           str(root / "ckpt" / f"step={SAVE_EVERY}.ckpt"), str(out), "--module", "model"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    plain = build("litgpt:llama3", seed=5)
    exported = load_file(out)
    assert set(exported) == set(plain.state_dict())
    plain.load_state_dict(exported, strict=True)
    saved = _merged(results, "uninterrupted", "after")
    for key, value in plain.state_dict().items():
        assert torch.equal(value, saved[key]), key
