"""GGUF for llama.cpp, one package: the weight and embedding types (`types`, plain data), the writer
(`writer`: HF -> GGUF names, the architecture choice, the streaming tensor writer, llama.cpp's
quantizer), the tokenizer keys (`tokenizer`), the checked header reader (`reader`), running a file in
llama.cpp (`llamacpp`), the deployment report (`deploy`) and the "gguf" export format (`format`,
declared in analysis.compress.export.format_registry and imported the first time it is used)."""
