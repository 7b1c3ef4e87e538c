"""The pre-flight's pieces that need no process group: the optimizer's name for the cost model, the batch's token
shape, the CUDA warning's advice, and the changes a memory advice is made of, priced."""

from __future__ import annotations

import torch

from examples.lit import CausalLM
from examples.models.llama import Llama, LlamaConfig
from lightning_nd.cost.alternatives import memory_changes, price
from lightning_nd.cost.memory import peak_rank
from lightning_nd.cost.shape import Workload, model_shape
from lightning_nd.model.batch import token_shape
from lightning_nd.planner.dry_run import dry_run
from lightning_nd.strategy.preflight import _over_capacity, optimizer_name

CONFIG = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4)


def test_optimizer_names():
    weight = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_name(torch.optim.AdamW(weight)) == "adamw" and optimizer_name(torch.optim.Adam(weight)) == "adam"
    assert optimizer_name(torch.optim.SGD(weight, lr=0.1)) == "sgd"
    assert optimizer_name(torch.optim.SGD(weight, lr=0.1, momentum=0.9)) == "sgd_momentum"


def test_token_shape_is_the_first_integer_matrix():
    batch = {"mask": torch.ones(2, 8), "input_ids": torch.zeros(2, 8, dtype=torch.long)}
    assert token_shape(batch) == (2, 8) and token_shape((torch.zeros(3, 5, dtype=torch.long),)) == (3, 5)
    assert token_shape({"x": torch.ones(2, 8)}) is None


def test_each_change_is_priced_with_the_same_global_batch():
    with torch.device("meta"):
        model = CausalLM(model=Llama(CONFIG))  # pp splits the model one attribute holds
    layout = dry_run(model, 4, {"dp_replicate": 2, "dp_shard": 2}, {})
    workload = Workload(seq_len=256, batch=8)

    def plan(sizes, options):
        return dry_run(model, 4, sizes, options)

    priced = price(layout, memory_changes(layout, workload), model_shape(model), workload, plan)
    before = peak_rank(layout, model_shape(model), workload).peak_bytes
    actions = {change.action: memory.peak_bytes for change, memory, _ in priced}
    assert {"NDParallel(activation_checkpointing='full')", "NDParallel(dp_replicate=1, dp_shard=4)",
            "NDParallel(tp=2, dp_shard=1)", "NDParallel(pp=2, dp_shard=1)"} <= set(actions)
    # Ring attention keeps what the fused kernel keeps for its half of the tokens: cp=2 lowers the peak too.
    assert "NDParallel(cp=2, dp_shard=1)" in actions
    assert all(peak < before for peak in actions.values()), (before, actions)
    assert min(actions, key=actions.get) == "NDParallel(pp=2, dp_shard=1)"
    halved = next(trial for change, _, trial in priced if change.batch is not None)
    assert (halved.batch, halved.accumulation) == (4, 2)
    message = _over_capacity(before, actions["NDParallel(activation_checkpointing='full')"] + 1, priced)
    assert "exceeds this GPU's" in message and "HINT: NDParallel(activation_checkpointing='full') is expected to peak at" in message
