"""`compile=True` (inductor, the default backend) matches one process under FSDP on 4 ranks."""

from __future__ import annotations

import torch

from tests.distributed.parity_ranks import techniques
from tests.launcher import launch


def test_inductor_compiled_blocks_match_one_process(tmp_path):
    per_rank = launch("tests.distributed.parity_ranks:run_layouts", 4, tmp_path, timeout=900, model_name="llama",
                      layouts={"fsdp4_inductor": {"dp_shard": 4, "compile": True}})
    result = per_rank[0]["fsdp4_inductor"]
    parallel, reference = result["parallel"], result["reference"]
    compiled = techniques(parallel)["compile"]
    assert compiled["details"]["backend"] == "inductor" and len(compiled["modules"]) == 2
    torch.testing.assert_close(torch.tensor(parallel["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=2e-6)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(parallel["params"][name], expected, rtol=1e-4, atol=5e-5)
