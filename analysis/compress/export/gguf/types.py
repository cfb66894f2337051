"""The GGUF weight types headscope writes and the embedding types llama.cpp's quantizer is told to use:
plain data (no torch, no gguf package), so the "gguf" format's declared options (its `--gguf-type` /
`--gguf-embedding-type` choices: analysis.compress.export.format_registry) are read without importing
the writer. analysis.compress.export.gguf.writer re-exports them and checks a type against them."""
from __future__ import annotations

# weight type -> (GGML type of 2-D weights written here or None = llama.cpp's quantizer,
#                 llama_ftype name for general.file_type / llama_model_quantize,
#                 bits of the weights: which self-check floor a file of this type must keep)
WEIGHT_TYPES: dict[str, tuple[str | None, str, int]] = {
    "f32": ("F32", "ALL_F32", 32),
    "f16": ("F16", "MOSTLY_F16", 16),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0", 8),
    "q4_k_m": (None, "MOSTLY_Q4_K_M", 4),
    "q5_k_m": (None, "MOSTLY_Q5_K_M", 5),
    "q6_k": (None, "MOSTLY_Q6_K", 6),
    "q4_0": (None, "MOSTLY_Q4_0", 4),    # 32-value blocks: fit any width that is a multiple of 32
    "q4_1": (None, "MOSTLY_Q4_1", 4),    # (the built-in SmolLM2 file's type)
}
DEFAULT_WEIGHT_TYPE = "f16"
# The type of the token embedding (and of output.weight) that llama.cpp's quantizer is told to use
# (`llama_model_quantize_params.token_embedding_type` / `output_tensor_type`, llama-quantize's
# --token-embedding-type / --output-tensor-type); "auto" = the quantizer's own choice. Only 32-value
# block types: llama.cpp applies an explicit type without its shape fallback, so a k-quant would fail
# on SmolLM2's 576-wide rows. With a tied embedding (SmolLM2) llama.cpp otherwise stores token_embd as
# Q8_0 whenever the width is not a multiple of 256 (docs/EXPORT.md, "Q4_K_M on SmolLM2").
EMBEDDING_TYPES: dict[str, str | None] = {"auto": None, "q8_0": "Q8_0", "q5_0": "Q5_0", "q4_1": "Q4_1",
                                          "q4_0": "Q4_0", "f16": "F16"}
DEFAULT_EMBEDDING_TYPE = "auto"
