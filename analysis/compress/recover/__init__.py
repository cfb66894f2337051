"""The cycle after the cut: distillation (`distill`), the iterative schedule (`pipeline`), PyTorch INT8 and
the measurement of INT8 files (`quantize`), and the compression report of a run (`report`)."""
