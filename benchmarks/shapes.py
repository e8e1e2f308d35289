"""Published shapes of the models the plan benchmarks compile for: the fields of each model's
Hugging Face config.json (from its model card), no weights. Instruct, Math and Coder variants
share their base model's shapes."""

QWEN25 = dict(model_type="qwen2", rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)

# The model of the peers' standard workload (shared/bench/peers/README.md), random weights.
PEER_QWEN2 = dict(
    model_type="qwen2",
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def bench_qwen2(hidden: int, layers: int) -> dict:
    """The random Qwen2 the update benchmarks train (ModelConfig fields): vocab 8,192, 8 heads
    of hidden / 8, 2 kv heads, MLP 3x wide, tied embeddings."""
    return dict(
        model_type="qwen2",
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=hidden // 8,
        tie_word_embeddings=True,
    )


CONFIG_JSON = {
    "qwen2.5-32b": dict(
        QWEN25,
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        QWEN25,
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
    "qwen2.5-3b": dict(
        QWEN25,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        QWEN25,
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        QWEN25,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=5e5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    ),
}
