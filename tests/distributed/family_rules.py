"""Which model family needs which tensor-parallel rule: data, not prose in the rules' docstrings. Each row is a style
(`lightning_nd/tensor_parallel/styles.py`), the file whose rule gives it, why, and families whose tp=2 plan uses it;
`test_hf_families.py::test_each_rule_is_what_its_families_plan_with` checks every family listed plans with it (in the
tp=2 launch of every family), so a rule that stops being used, or a family that stops needing it, shows."""

from __future__ import annotations

RULES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "packed_qkv": ("infer/names.py", "one fused [q; k; v] projection (`c_attn`), split by `split_size`",
                   ("gpt2", "openai-gpt", "gpt-sw3")),
    "packed_colwise": ("infer/ssm.py, infer/names.py", "a fused [gate; up] or [x; z] input projection, part by part",
                       ("mamba", "jamba", "jetmoe", "moshi")),
    "colwise_rep": ("infer/declared.py", "declared by the model: a colwise layer whose output is gathered",
                    ("glm", "glm4", "olmo2", "phi3")),
    "rowwise_split_input": ("infer/declared.py", "declared by the model: a rowwise layer taking a whole input",
                            ("glm", "olmo2", "phi3")),
    "mla_kv_a_proj": ("infer/mla.py", "multi-head latent attention: the shared rotary key's gradient summed over tp",
                      ("deepseek_v2", "deepseek_v3", "minicpm3", "longcat_flash")),
    "down_projection": ("infer/mla.py", "a low-rank latent kept whole in front of its colwise layer",
                        ("deepseek_v2", "deepseek_v3", "minicpm3")),
    "replicated_with_grad_allreduce": ("infer/resolve.py", "per-head norms (q_norm, k_norm) between a colwise and a"
                                       " rowwise layer: whole, gradients summed", ("qwen3", "qwen3_moe", "gemma3_text")),
    "per_head_params": ("infer/per_feature.py", "a module's own per-head vectors (attention sinks, gates), split by head",
                        ("beam", "doge", "granite_swa", "neomme")),
    "per_head_rowwise": ("infer/per_feature.py", "a rowwise layer whose output a per-head module reads", ("doge",)),
    "channel_mixer": ("infer/ssm.py", "a selective state-space mixer split by channels",
                      ("mamba", "falcon_mamba", "jamba")),
    "per_channel_vectors": ("infer/ssm.py", "RWKV's time and channel mixing: per-channel vectors split", ("rwkv",)),
    "stacked_packed_colwise": ("infer/stacked_experts.py", "experts stored as one [E, out, in] weight", ("jetmoe",)),
    "transposed_experts": ("infer/hugging_face.py", "experts stored [E, H, 2I], every token through every expert",
                           ("llama4_text",)),
}
