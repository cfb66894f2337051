"""Run an ONNX file over token windows and save its outputs: numpy and ONNX Runtime only, so that it
starts in seconds under qemu-user (tests/test_cpu_paths.py runs it with an AVX2-only CPU model).

    python tests/_ort_logits.py model.onnx ids.npy out.npy      # ids [n, T] int64 -> out [n, T, V]
"""
import sys

import numpy as np
import onnxruntime as ort


def main(model: str, ids_file: str, out_file: str) -> None:
    ids = np.load(ids_file)                                                    # [n, T]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    out = [session.run(None, {"input_ids": row[None], "attention_mask": np.ones_like(row[None])})[0][0]
           for row in ids]                                                     # n x [T, V]
    np.save(out_file, np.stack(out))


if __name__ == "__main__":
    main(*sys.argv[1:4])
