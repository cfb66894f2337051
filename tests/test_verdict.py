"""Stages worse than their input are named (analysis/compress/verdict.py): the deployment report's pruned
GGUF slower or bigger than dense, in its rows (the download) and in the table the Export page draws."""
from analysis.compress.export.gguf.deploy import worse_than_dense


def _row(decode, prefill=100.0, size=100 * 2**20, kv=96.0):
    return {"bytes": size, "perplexity": 20.0, "headscope_perplexity": 20.1, "prefill_tok_s": prefill,
            "decode_tok_s": decode, "kv_mib_4096": kv, "heads": 270, "kv_heads": 90, "tensor_types": "F16 1 (1 MiB)"}


def test_a_slower_pruned_gguf_is_named():
    """Issue 33: the pruned GGUF measured 1.30 vs 5.81 tok/s decode went without a word."""
    flags = worse_than_dense(_row(5.81), _row(1.30, size=90 * 2**20, kv=80.0))
    assert flags == ["decode 4.47x slower"]
    assert worse_than_dense(_row(5.81), _row(6.2, size=90 * 2**20, kv=80.0)) == []
    assert worse_than_dense(_row(5.81), _row(5.81, kv=120.0)) == ["KV cache at 4096 tokens 1.25x bigger"]


def test_deployment_table_marks_the_worse_rows():
    from components.numbers import deployment_table
    rows = {r["measure"]: r for r in deployment_table(_row(5.81), _row(1.30, size=90 * 2**20, kv=80.0))}
    assert rows["decode tokens/s"]["pruned vs dense"] == "4.47x slower" and rows["decode tokens/s"]["worse"]
    assert rows["prefill tokens/s"]["pruned vs dense"].startswith("same speed") and not rows["prefill tokens/s"]["worse"]
    assert rows["file size (MiB)"]["pruned vs dense"] == "0.9x" and not rows["file size (MiB)"]["worse"]
    assert not rows["perplexity (llama.cpp)"]["worse"]       # a cut is expected to change it: measured, not flagged
