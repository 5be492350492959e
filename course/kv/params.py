"""Exact parameter counts from a config.json, for the weights term of the budget and the roofline."""

from __future__ import annotations


def count_params(config: dict) -> int | None:
    """Exact parameter count of a model from its config.json, or None for architectures it does not know.

    Covers Llama-style decoders (llama, mistral, mixtral with its experts, qwen2/qwen3, gemma/gemma2,
    phi3), GPT-2 and Falcon's original (7B) architecture, by adding up every weight matrix, bias
    and norm. Tied input and output embeddings count once. MLA/MoE designs such as DeepSeek's return
    None: give their published count instead.
    """
    try:
        return _count_params(config)
    except (KeyError, TypeError, ArithmeticError):  # missing, wrong-type or zero fields: the reader says which
        return None


def _count_params(cfg: dict) -> int | None:
    kind = str(cfg.get("model_type", "")).lower()
    if kind == "gpt2":
        h, layers, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
        inner = cfg.get("n_inner") or 4 * h
        per_layer = (
            2 * h  # ln_1 (weight, bias)
            + h * 3 * h
            + 3 * h  # c_attn
            + h * h
            + h  # attention c_proj
            + 2 * h  # ln_2
            + h * inner
            + inner  # c_fc
            + inner * h
            + h  # mlp c_proj
        )
        return vocab * h + cfg.get("n_positions", 1024) * h + layers * per_layer + 2 * h  # tied lm_head; ln_f
    if kind == "falcon" and not cfg.get("new_decoder_architecture") and not cfg.get("bias"):
        h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        heads = cfg["num_attention_heads"]
        head_dim = h // heads
        kv = 1 if cfg.get("multi_query", True) else heads
        per_layer = h * (heads + 2 * kv) * head_dim + h * h + 2 * h * 4 * h + 2 * h  # qkv, dense, mlp, one layernorm
        return vocab * h + layers * per_layer + 2 * h  # tied lm_head; ln_f
    if kind not in {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}:
        return None
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    q_size, kv_size = heads * head_dim, kv * head_dim
    attention = h * q_size + 2 * h * kv_size + q_size * h
    if kind == "qwen2" or cfg.get("attention_bias"):
        attention += q_size + 2 * kv_size  # q, k, v biases (Qwen2 always has them)
    if kind == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * h * cfg["intermediate_size"]
    if kind == "mixtral":
        experts = cfg["num_local_experts"]
        mlp = experts * mlp + h * experts  # every expert, plus the router
    norms = (4 if kind in ("gemma2",) else 2) * h
    tied = cfg.get("tie_word_embeddings", kind.startswith("gemma"))
    embeddings = vocab * h * (1 if tied else 2)
    return embeddings + layers * (attention + mlp + norms) + h  # final norm
