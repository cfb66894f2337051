"""GGUF for llama.cpp, one package: the writer (`writer`: HF -> GGUF names, the architecture choice, the
streaming tensor writer, llama.cpp's quantizer), the tokenizer keys (`tokenizer`), the checked header
reader (`reader`), running a file in llama.cpp (`llamacpp`), the deployment report (`deploy`) and the
"gguf" export format (`format`, registered when this package is imported)."""
from analysis.compress.export.gguf import format  # noqa: F401  (registers the "gguf" format)
