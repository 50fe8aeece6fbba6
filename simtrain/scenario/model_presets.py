"""Published models, by name: `model.preset` (scenario/model.py) fills the model's shape from one.

A preset gives the model section's fields (name, width, blocks, heads,
key/value heads, SwiGLU width, rotary base, experts, latent attention) and the
data's vocabulary and pre-training sequence length (`data.vocab`,
`data.seq_len`, with `data.name: tokens`). A field the scenario gives wins
over the preset's, one level deep into `model.moe` and
`model.latent_attention` too (`moe: {capacity_factor: 1.25}` keeps the
preset's experts); the data's fields are filled only where the data section is
`tokens` (or not named) and does not give them. How the model trains
(attention kernel, precision, recomputation) is not part of a preset.

Sources, each next to its numbers below:

- **llama3-8b, llama3-70b, llama3-405b**: Grattafiori et al. 2024, "The Llama
  3 Herd of Models" (arXiv 2407.21783), table 3, vocabulary 128,256, RoPE
  base 500,000, sequence 8,192 (section 3.4.1). Llama 3.1's models are the
  same shapes (its long-context RoPE scaling is not modelled). Published
  sizes (Meta's model cards): 8.03B, 70.6B, 405.9B.
- **gpt3-175b**: Brown et al. 2020, "Language Models are Few-Shot Learners"
  (arXiv 2005.14165), table 2.1: 96 layers, width 12,288, 96 heads, context
  2,048; GPT-2's vocabulary of 50,257 (section 2.1). 175.0B. GPT-3 ties its
  output head to the token table; simtrain's gpt does not, which adds 0.62B
  (0.35%).
- **mixtral-8x7b**, **mixtral-8x22b**: Jiang et al. 2024, "Mixtral of
  Experts" (arXiv 2401.04088), table 1, and the config.json of
  mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 on Hugging Face (8
  experts of the dense SwiGLU width, top 2, RoPE base 1,000,000; context
  32,768 and 65,536). Published: 46.7B total / 12.9B active, 141B / 39B
  (Mistral AI's announcements).
- **deepseek-v3**: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (arXiv
  2412.19437), section 4.2 and its config.json: 61 layers of width 7168, the
  first 3 dense (SwiGLU of 18,432), 256 routed experts of 2,048 and one
  shared, top 8 by sigmoid affinities, node-limited to 4 of 8 groups;
  multi-head latent attention with 128 heads (q latent 1,536, kv latent 512,
  128 + 64 query/key features a head, 128 value features); vocabulary
  129,280; sequence 4,096. 671B total, 37B activated a token.

    with_model_preset({"preset": "llama3-8b", "layers": 2})["hidden"]   # 4096
"""
from typing import Literal

_LLAMA3 = {"name": "llama", "kv_heads": 8, "rope_theta": 500000.0}  # arXiv 2407.21783, table 3
_LLAMA3_DATA = {"vocab": 128256, "seq_len": 8192}
_MIXTRAL_MOE = {"experts": 8, "top_k": 2}  # arXiv 2401.04088, table 1: 8 experts, top 2

MODEL_PRESETS: dict[str, dict] = {
    "llama3-8b": {"model": {**_LLAMA3, "hidden": 4096, "layers": 32, "heads": 32, "ffn_hidden": 14336},
                  "data": _LLAMA3_DATA},
    "llama3-70b": {"model": {**_LLAMA3, "hidden": 8192, "layers": 80, "heads": 64, "ffn_hidden": 28672},
                   "data": _LLAMA3_DATA},
    "llama3-405b": {"model": {**_LLAMA3, "hidden": 16384, "layers": 126, "heads": 128, "ffn_hidden": 53248},
                    "data": _LLAMA3_DATA},
    # arXiv 2005.14165, table 2.1 (n_layers 96, d_model 12288, n_heads 96, n_ctx 2048); vocabulary 50,257
    "gpt3-175b": {"model": {"name": "gpt", "hidden": 12288, "layers": 96, "heads": 96},
                  "data": {"vocab": 50257, "seq_len": 2048}},
    # mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size 4096, num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, intermediate_size 14336, rope_theta 1e6, vocab_size 32000, max_position 32768
    "mixtral-8x7b": {"model": {"name": "llama", "hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8,
                               "ffn_hidden": 14336, "rope_theta": 1e6, "moe": _MIXTRAL_MOE},
                     "data": {"vocab": 32000, "seq_len": 32768}},
    # mistralai/Mixtral-8x22B-v0.1 config.json: hidden_size 6144, num_hidden_layers 56, num_attention_heads 48,
    # num_key_value_heads 8, intermediate_size 16384, rope_theta 1e6, vocab_size 32768, max_position 65536
    "mixtral-8x22b": {"model": {"name": "llama", "hidden": 6144, "layers": 56, "heads": 48, "kv_heads": 8,
                                "ffn_hidden": 16384, "rope_theta": 1e6, "moe": _MIXTRAL_MOE},
                      "data": {"vocab": 32768, "seq_len": 65536}},
    # arXiv 2412.19437 section 4.2 and deepseek-ai/DeepSeek-V3 config.json (hidden_size 7168, num_hidden_layers
    # 61, num_attention_heads 128, intermediate_size 18432, moe_intermediate_size 2048, n_routed_experts 256,
    # n_shared_experts 1, num_experts_per_tok 8, first_k_dense_replace 3, scoring_func sigmoid, n_group 8,
    # topk_group 4, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim
    # 128, vocab_size 129280; rope_theta 10000, the model's default)
    "deepseek-v3": {"model": {"name": "llama", "hidden": 7168, "layers": 61, "heads": 128, "ffn_hidden": 18432,
                              "latent_attention": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                                   "qk_rope_head_dim": 64, "v_head_dim": 128},
                              "moe": {"experts": 256, "expert_hidden": 2048, "top_k": 8, "shared_experts": 1,
                                      "first_dense": 3, "score": "sigmoid", "groups": 8, "group_limit": 4}},
                    "data": {"vocab": 129280, "seq_len": 4096}},
}
ModelPresetName = Literal[tuple(MODEL_PRESETS)]
_NESTED = ("moe", "latent_attention")  # sections merged one level deep


def _preset_of(raw) -> dict | None:
    """The preset a raw model section names; None where it names none or an unknown one (the field refuses it)."""
    name = raw.get("preset") if isinstance(raw, dict) else None
    return MODEL_PRESETS.get(name) if isinstance(name, str) else None


def with_model_preset(raw):
    """The raw model section with its preset's fields under the ones it gives (each field it gives wins; in moe and
    latent_attention, each of their fields)."""
    preset = _preset_of(raw)
    if preset is None:
        return raw
    merged = {**preset["model"], **raw}
    for key in _NESTED:
        if isinstance(preset["model"].get(key), dict) and isinstance(raw.get(key), dict):
            merged[key] = {**preset["model"][key], **raw[key]}
    return merged


def with_data_preset(raw_model, raw_data):
    """The raw data section with the model preset's vocabulary and sequence length where it does not give them
    (a tokens data set, or one not named)."""
    preset = _preset_of(raw_model)
    if preset is None or not isinstance(raw_data, dict) or raw_data.get("name", "tokens") != "tokens":
        return raw_data
    return {"name": "tokens", **preset["data"], **raw_data}
