"""Tiny random-weight models of every supported family, built in-process from configs.

Good for structure and exactness tests (masking == zeroed weights, surgery == masking),
meaningless for quality. Every model is eval mode and seeded; float32 unless the test asks for
float64 (the exactness tests do: see tests/_tolerance.py).
"""
import torch
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM,
                          AutoModelForMaskedLM)

VOCAB = 128

# model_type -> (auto class, config overrides). GQA families get H=4, Hkv=2.
_GQA = dict(num_attention_heads=4, num_key_value_heads=2)
TINY_SPECS = {
    "llama": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, **_GQA)),
    "mistral": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, head_dim=8, **_GQA)),
    "qwen2": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, **_GQA)),
    "qwen3": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, head_dim=12, **_GQA)),
    "gemma": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, head_dim=8, **_GQA)),
    "gemma2": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, head_dim=8, **_GQA)),
    "gemma3_text": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, head_dim=8, **_GQA)),
    "phi": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)),
    "phi3": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, pad_token_id=0, **_GQA)),
    "bloom": (AutoModelForCausalLM, dict(hidden_size=32, n_head=4)),
    "electra": (AutoModelForMaskedLM, dict(hidden_size=32, embedding_size=32, intermediate_size=64,
                                           num_attention_heads=4)),
    "gpt2": (AutoModelForCausalLM, dict(n_embd=32, n_head=4, n_positions=64)),
    "gpt_neox": (AutoModelForCausalLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)),
    "gptj": (AutoModelForCausalLM, dict(n_embd=32, n_head=4, n_positions=64, rotary_dim=4)),
    "opt": (AutoModelForCausalLM, dict(hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                       word_embed_proj_dim=32)),
    "bert": (AutoModelForMaskedLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)),
    "roberta": (AutoModelForMaskedLM, dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                           pad_token_id=1)),
    "xlm-roberta": (AutoModelForMaskedLM, dict(hidden_size=32, intermediate_size=64,
                                               num_attention_heads=4, pad_token_id=1)),
    "distilbert": (AutoModelForMaskedLM, dict(dim=32, hidden_dim=64, n_heads=4)),
}
FAMILIES = tuple(TINY_SPECS)
_COMMON = dict(num_hidden_layers=2, n_layer=2, n_layers=2, vocab_size=VOCAB,
               max_position_embeddings=64)


def tiny_config(model_type: str, **overrides):
    """A 2-layer config of `model_type` with hidden 32 and 4 heads (2 KV heads where GQA)."""
    auto_cls, spec = TINY_SPECS[model_type]
    kwargs = {**_COMMON, **spec, **overrides}
    cfg = AutoConfig.for_model(model_type, **kwargs)
    return cfg


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A seeded random-weight tiny model (eval) with every bias non-zero; float32 unless `dtype`
    says otherwise (exactness tests pass torch.float64: the same seeded weights, cast)."""
    auto_cls, _ = TINY_SPECS[model_type]
    torch.manual_seed(seed)
    model = auto_cls.from_config(tiny_config(model_type, **overrides), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)  # HF inits biases to 0, which would hide bias bugs
            elif "norm" in name or "ln" in name:
                p.normal_(1.0, 0.1)
    return model.to(dtype).eval()


def tiny_input_ids(batch: int = 2, seq: int = 10, seed: int = 1) -> torch.Tensor:
    """Random token ids avoiding the first 4 ids (often special/pad)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (batch, seq), generator=g)  # [batch, seq]
