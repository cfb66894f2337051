"""Benchmark (issue 22): weights-only work on an 8B-shaped checkpoint, against copying the folder.

Writes a synthetic Llama checkpoint with the shapes of a published 8B GQA model (32 layers, 32
query / 8 KV heads, hidden 4096, FFN 14336, vocabulary 128256, untied LM head; bfloat16, about
16 GB in 4 shards) into a scratch folder, then measures, each in a fresh child process (peak RSS
= the child's VmHWM, from wait4's ru_maxrss):

    cp      `cp -r` of the checkpoint folder
    read    one read of every attention tensor (Q/K/V/O of every layer), in one thread, into one buffer per
            role reused layer after layer (memory already touched: no page faults): the physical limit of MP-G
    mp-g    MP-G scoring from the checkpoint (streamed profile + score), as `score --checkpoint` does
    export  the streamed export (analysis.compress.export.streamed) of a 25% cut, mask policy "groups"

Each pair is timed with bench/_timing.compare: interleaved pairs (read, mp-g, then mp-g, read, ...;
the same for export and cp) until the spread of the per-pair ratios is known or --max-pairs, min /
median / max of each side and of the ratio, the load average; a target is judged on the median
per-pair ratio. Each output is deleted after its run (not timed). --cold drops the checkpoint's pages
from the page cache before every
run (posix_fadvise DONTNEED on its files: only these files, nothing else on the machine); without
it the runs read whatever the page cache still holds (warm-ish: say so). Times are the wall time
of the work inside the child (imports excluded; cp: the whole process) and, separately, with the
written files fsync'ed. Then a 70B shape (80 layers, 64 / 8 heads, hidden 8192, FFN 28672):
the config-only plan of all 80 layers (meta skeleton, layout, counts, stock check; no tensors)
and a real streamed export of a checkpoint with --big-layers of its layers.

    .venv/bin/python -m bench.bench_anysize [--scratch /work/tmp-anysize] [--pairs 5 --max-pairs 9] [--cold]
        [--checkpoint DIR (reuse one written with --keep)] [--score-only | --export-only]
        [--layers 32 --heads 32 --kv-heads 8 --hidden 4096 --ffn 14336 --vocab 128256 --shards 4]
        [--big-layers 2] [--skip-70b] [--skip-8b] [--export-only] [--keep]
Targets: export wall <= 1.5x cp; peak RSS <= 2 GiB; MP-G <= 1.2x one read of the attention tensors.
Needs about 2.1x the checkpoint's size free on the scratch disk (checkpoint + one copy at a time).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

from bench._timing import compare  # noqa: E402

GIB = 2**30
GIB_RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


# ---------------------------------------------------------------------------------------------
# The synthetic checkpoint
# ---------------------------------------------------------------------------------------------

def llama_tensors(layers, heads, kv_heads, hidden, ffn, vocab, d=None):
    """[(name, shape)] of a Llama-style causal LM in save_pretrained order (untied LM head)."""
    d = d or hidden // heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (heads * d, hidden)),
                (p + "self_attn.k_proj.weight", (kv_heads * d, hidden)),
                (p + "self_attn.v_proj.weight", (kv_heads * d, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * d)),
                (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (ffn, hidden)),
                (p + "mlp.up_proj.weight", (ffn, hidden)),
                (p + "mlp.down_proj.weight", (hidden, ffn))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def write_checkpoint(folder: Path, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int,
                     shards: int) -> int:
    """Write the checkpoint (tensor by tensor, through the streamed export's SafetensorsWriter);
    returns its bytes. Values: slices of a 64 MiB pool of N(0, 0.02) bfloat16 at random offsets
    (random weights without generating 16 GB of random numbers on a shared CPU)."""
    import torch
    from transformers import LlamaConfig

    from analysis.arch.checkpoint import INDEX_FILE
    from analysis.compress.export.streamed import SafetensorsWriter

    folder.mkdir(parents=True)
    LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                hidden_size=hidden, intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=False,
                max_position_embeddings=8192, dtype="bfloat16", architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(32 * 2**20, generator=g) * 0.02).to(torch.bfloat16)          # [32M] = 64 MiB
    specs = llama_tensors(layers, heads, kv_heads, hidden, ffn, vocab)
    sizes = [2 * _numel(shape) for _, shape in specs]
    per_shard = sum(sizes) / shards
    groups, current, acc = [], [], 0
    for spec, size in zip(specs, sizes):
        if current and acc + size > per_shard * (len(groups) + 1) and len(groups) < shards - 1:
            groups.append(current)
            current = []
        current.append(spec)
        acc += size
    groups.append(current)
    weight_map = {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        writer = SafetensorsWriter(folder / name, [(n, "BF16", s) for n, s in group], {"format": "pt"})
        for tensor_name, shape in group:
            n = _numel(shape)
            start = int(torch.randint(0, pool.numel(), (1,), generator=g))
            reps = (start + n) // pool.numel() + 1
            values = pool.repeat(reps)[start:start + n] if reps > 1 else pool[start:start + n]
            writer.write(tensor_name, values.reshape(shape))
            weight_map[tensor_name] = name
            del values
        writer.close()
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------------
# Children: each measured job in a fresh process; it prints one JSON line
# ---------------------------------------------------------------------------------------------

CHILD = r"""
import json, os, sys, time
mode, folder, out = sys.argv[1], sys.argv[2], sys.argv[3]     # run with cwd = the repository root (`bench.`)
from pathlib import Path
import numpy as np

def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

if mode == "write":
    from bench.bench_anysize import write_checkpoint
    start = time.perf_counter()
    size = write_checkpoint(Path(folder), *json.loads(out))
    print(json.dumps({"seconds": time.perf_counter() - start, "bytes": size}))
elif mode == "read":
    from analysis.arch.adapters import adapter_for
    from analysis.arch.checkpoint import checkpoint_entries, load_config
    from analysis.arch.checkpoint import read_tensors
    from analysis.compress.export.streamed import _layer_roles, _prefix
    folder = Path(folder)
    config = load_config(folder)
    adapter = adapter_for(config)
    g = adapter.geometry(config)
    start = time.perf_counter()
    entries = checkpoint_entries(folder)
    prefix = _prefix(adapter, entries)
    nbytes, buffers = 0, {}                 # one buffer per role, reused layer after layer: the bytes land in
    for layer in range(g.n_layers):         # memory already touched (no page faults), the fastest plain read
        tensors = read_tensors(_layer_roles(adapter, layer, entries, prefix), entries, None, buffers)
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "bytes": nbytes}))
elif mode == "mpg":
    from analysis.measure.streaming import profile_checkpoint
    from analysis.score.scoring import get_scorer
    from analysis.score.masks import plan_mask
    from analysis.compress.export import mask_record
    from analysis.arch.adapters import adapter_for
    from analysis.arch.checkpoint import load_config
    start = time.perf_counter()
    profile = profile_checkpoint(folder, ords=(2,))     # what MP-G reads, as the CLI asks for it
    scores = get_scorer("mp-g").score(profile)
    seconds = time.perf_counter() - start
    config = load_config(Path(folder))
    adapter = adapter_for(config)
    g = adapter.geometry(config)
    plan = plan_mask(scores, 0.25, group_size=g.group_size, policy="groups")
    record = mask_record(plan.pruned, geometry=g, model=folder, model_type=adapter.model_type, scores=scores,
                         sparsity=0.25, policy="groups")
    Path(out).write_text(record.to_json())
    print(json.dumps({"seconds": seconds, "n_pruned": int(plan.n_pruned)}))
elif mode == "randmask":           # a 25% groups mask from seeded random scores (for --export-only)
    from analysis.score.masks import plan_mask
    from analysis.compress.export import mask_record
    from analysis.arch.adapters import adapter_for
    from analysis.arch.checkpoint import load_config
    config = load_config(Path(folder))
    adapter = adapter_for(config)
    g = adapter.geometry(config)
    scores = np.random.default_rng(0).random((g.n_layers, g.n_heads))
    plan = plan_mask(scores, 0.25, group_size=g.group_size, policy="groups")
    Path(out).write_text(mask_record(plan.pruned, geometry=g, model=folder, model_type=adapter.model_type,
                                     sparsity=0.25, policy="groups").to_json())
    print(json.dumps({"n_pruned": int(plan.n_pruned)}))
elif mode == "export":
    from analysis.compress.export import read_mask_json
    from analysis.compress.export.streamed import export_checkpoint
    record = read_mask_json(sys.argv[4])
    start = time.perf_counter()
    result = export_checkpoint("pruned", folder, record.pruned(), out, record=record)
    seconds = time.perf_counter() - start
    fsync_tree(out)
    print(json.dumps({"seconds": seconds, "seconds_fsync": time.perf_counter() - start,
                      "bytes": result.total_bytes}))
elif mode == "plan70b":
    import torch
    from transformers import LlamaConfig
    from analysis.arch.adapters import adapter_for
    from analysis.compress.export import stock_check
    from analysis.compress.export.streamed import _skeleton
    from analysis.compress.surgery import HeadLayout
    from analysis.score.masks import plan_mask, summarize_mask
    config = LlamaConfig(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                         intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    start = time.perf_counter()
    adapter = adapter_for(config)
    g = adapter.geometry(config)
    skeleton = _skeleton(config)
    n_params = sum(p.numel() for p in skeleton.parameters())
    scores = np.random.default_rng(0).random((g.n_layers, g.n_heads))
    plan = plan_mask(scores, 0.25, group_size=g.group_size, policy="groups")
    layout = HeadLayout.from_mask(plan.pruned, g, adapter.model_type)
    summary = summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, kv_policy="auto", dtype_bytes=2)
    stock = stock_check(config, plan.pruned)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "params": n_params, "n_pruned": plan.n_pruned,
                      "layer_counts": sorted(set(map(tuple, summary.surgery.layer_counts))),
                      "params_removed": summary.params_removed, "stock_ok": stock.ok}))
"""


def _drop_cache(folder: Path) -> None:
    """Evict `folder`'s files from the page cache (only these files)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_child(argv: list[str]) -> tuple[dict, float, int]:
    """(the child's JSON line, wall seconds of the whole process, peak RSS in bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.stdout.read(), proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"child {argv[:4]} failed ({proc.returncode}): {err.strip()[-2000:]}")
    line = out.strip().splitlines()[-1] if out.strip() else "{}"
    return json.loads(line), wall, usage.ru_maxrss * 1024


def py_child(mode: str, folder: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, "-c", CHILD, mode, str(folder), str(out), *map(str, extra)]


def write(folder: Path, *shape) -> int:
    """write_checkpoint in a child process (this process stays small: a child forked from it would
    count its memory in the child's peak RSS)."""
    data, wall, peak = run_child(py_child("write", folder, json.dumps(shape)))
    print(f"wrote {folder}: {data['bytes'] / GIB:.2f} GiB in {len(list(folder.glob('*.safetensors')))} shards "
          f"({data['seconds']:.0f} s, peak RSS {peak / GIB:.2f} GiB)", flush=True)
    return data["bytes"]


def _stats(values: list[float]) -> str:
    return f"min {min(values):.2f}  median {statistics.median(values):.2f}  max {max(values):.2f}"


def _fsync_tree(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def bench_8b(args, scratch: Path) -> dict:
    if args.checkpoint:                      # one written before (e.g. with --keep), reused as it is
        ckpt = Path(args.checkpoint)
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        print(f"reusing {ckpt}: {size / GIB:.2f} GiB in {len(list(ckpt.glob('*.safetensors')))} shards", flush=True)
    else:
        ckpt = scratch / "ckpt-8b"
        size = write(ckpt, args.vocab, args.layers, args.heads, args.kv_heads, args.hidden, args.ffn, args.shards)
    cache = ("cold (checkpoint evicted from the page cache before each run)" if args.cold else
             f"warm-ish (whatever the page cache holds; {GIB_RAM:.0f} GiB RAM for a {size / GIB:.0f} GiB checkpoint)")
    results = {k: [] for k in ("cp_fsync", "export_fsync")}
    rss = {k: [] for k in ("cp", "export", "read", "mpg")}
    mask = scratch / "mask.json"

    def cp():
        target = scratch / "copy"
        if args.cold:
            _drop_cache(ckpt)
        _, wall, peak = run_child(["cp", "-r", str(ckpt), str(target)])
        start = time.perf_counter()
        _fsync_tree(target)
        results["cp_fsync"].append(wall + time.perf_counter() - start)
        rss["cp"].append(peak)
        shutil.rmtree(target)
        return wall

    def export():
        target = scratch / "exports" / "cut"
        if args.cold:
            _drop_cache(ckpt)
        data, _, peak = run_child(py_child("export", ckpt, target, mask))
        results["export_fsync"].append(data["seconds_fsync"])
        rss["export"].append(peak)
        results.setdefault("export_bytes", data["bytes"])
        shutil.rmtree(scratch / "exports")
        return data["seconds"]

    def read():
        if args.cold:
            _drop_cache(ckpt)
        data, _, peak = run_child(py_child("read", ckpt, scratch / "unused"))
        results["attention_bytes"] = data["bytes"]
        rss["read"].append(peak)
        return data["seconds"]

    def mpg():
        if args.cold:
            _drop_cache(ckpt)
        data, _, peak = run_child(py_child("mpg", ckpt, mask))
        rss["mpg"].append(peak)
        return data["seconds"]

    pairs = dict(min_pairs=args.pairs, max_pairs=args.max_pairs, max_seconds=args.max_seconds, warm=not args.cold,
                 self_timed=True)
    print(f"\n8B-shaped checkpoint: {size / GIB:.2f} GiB; page cache: {cache}; {os.cpu_count()} CPUs", flush=True)
    out = {}
    if not args.export_only:                 # also writes the 25% groups mask the export cuts
        out["mpg"] = compare({"MP-G scoring": mpg, "attention read": read}, **pairs)
        out["mpg"].report(f"MP-G scoring vs one read of the attention tensors "
                          f"({results['attention_bytes'] / GIB:.2f} GiB)", unit=1.0, unit_name="s", target="<= 1.2x")
        print(f"  peak RSS: MP-G {max(rss['mpg']) / GIB:.2f} GiB, read {max(rss['read']) / GIB:.2f} GiB")
    elif not mask.exists():                  # the mask from seeded random scores
        run_child(py_child("randmask", ckpt, mask))
    if not args.score_only:
        out["export"] = compare({"streamed export 25%": export, "cp -r": cp}, **pairs)
        out["export"].report(f"streamed export (wrote {results['export_bytes'] / GIB:.2f} GiB) vs cp -r of the folder",
                             unit=1.0, unit_name="s", target="<= 1.5x")
        print(f"  with fsync of the written files: export {_stats(results['export_fsync'])} s, "
              f"cp {_stats(results['cp_fsync'])} s")
        peak = max(rss["export"]) / GIB
        print(f"  peak RSS: export {peak:.2f} GiB (target <= 2 GiB: {'PASS' if peak <= 2 else 'FAIL'}), "
              f"cp {max(rss['cp']) / GIB:.2f} GiB")
    for name, c in out.items():
        limit = 1.2 if name == "mpg" else 1.5
        print(f"  {c.a} / {c.b} = {c.ratio:.2f}x (median of {len(c.ratios)} interleaved pairs)   target <= {limit}x: "
              f"{'PASS' if c.ratio <= limit else 'FAIL'}")
    if not args.keep and not args.checkpoint:
        shutil.rmtree(ckpt)
    return out


def bench_70b(args, scratch: Path) -> None:
    data, wall, peak = run_child(py_child("plan70b", scratch, scratch / "unused"))
    print(f"\n70B shape, config only (80 layers, 64 / 8 heads, hidden 8192): meta skeleton of "
          f"{data['params'] / 1e9:.1f}B parameters + 25% groups plan + layout + counts + stock check in "
          f"{data['seconds']:.2f} s, peak RSS {peak / GIB:.2f} GiB; {data['n_pruned']} heads pruned, (query, KV) "
          f"per layer {data['layer_counts']}, {data['params_removed'] / 1e9:.2f}B attention parameters removed, "
          f"stock config: {data['stock_ok']}")
    if not args.big_layers:
        return
    ckpt = scratch / "ckpt-70b"
    size = write(ckpt, args.vocab, args.big_layers, 64, 8, 8192, 28672, max(1, args.big_layers))
    mask = scratch / "mask-70b.json"
    run_child(py_child("mpg", ckpt, mask))
    data, wall, peak = run_child(py_child("export", ckpt, scratch / "exports" / "cut70", mask))
    print(f"70B widths, {args.big_layers} layers' tensors ({size / GIB:.2f} GiB, embeddings 2 GiB each): streamed "
          f"export {data['seconds']:.2f} s, wrote {data['bytes'] / GIB:.2f} GiB, peak RSS {peak / GIB:.2f} GiB")
    shutil.rmtree(scratch / "exports")
    shutil.rmtree(ckpt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", default="/work/tmp-anysize")
    parser.add_argument("--pairs", type=int, default=5, help="at least this many interleaved pairs per comparison")
    parser.add_argument("--max-pairs", dest="max_pairs", type=int, default=9)
    parser.add_argument("--max-seconds", dest="max_seconds", type=float, default=600.0,
                        help="no new pair after this many seconds of one comparison (once --pairs are done)")
    parser.add_argument("--checkpoint", help="reuse this 8B-shaped checkpoint folder (written before with --keep) "
                                             "instead of writing one; it is not deleted")
    parser.add_argument("--cold", action="store_true", help="evict the checkpoint from the page cache before each run")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", dest="kv_heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--big-layers", dest="big_layers", type=int, default=2)
    parser.add_argument("--skip-70b", dest="skip_70b", action="store_true")
    parser.add_argument("--skip-8b", dest="skip_8b", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the scratch checkpoint")
    parser.add_argument("--export-only", dest="export_only", action="store_true",
                        help="only cp vs the streamed export (mask: 25%% groups from seeded random scores)")
    parser.add_argument("--score-only", dest="score_only", action="store_true",
                        help="only one read of the attention tensors vs MP-G scoring")
    args = parser.parse_args()
    scratch = Path(args.scratch)
    if args.checkpoint and Path(args.checkpoint).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit("--checkpoint must lie outside --scratch (the scratch folder is emptied at the end)")
    if scratch.exists() and any(scratch.iterdir()):
        raise SystemExit(f"{scratch} is not empty; remove it or pass another --scratch")
    scratch.mkdir(parents=True, exist_ok=True)
    d = args.hidden // args.heads
    need = 2 * 2.1 * (args.layers * (args.hidden * d * (2 * args.heads + 2 * args.kv_heads) + 3 * args.hidden * args.ffn)
                      + 2 * args.vocab * args.hidden)
    if args.checkpoint:
        need = need / 2.1 * 1.1              # the checkpoint is there already: room for one copy
    free = shutil.disk_usage(scratch).free
    print(f"scratch {scratch}: {free / GIB:.1f} GiB free, this shape needs about {need / GIB:.1f} GiB; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs", flush=True)
    if free < need and not args.skip_8b:
        raise SystemExit("not enough free disk for this shape: pass smaller --layers / --ffn / --vocab, and say so")
    try:
        if not args.skip_8b:
            bench_8b(args, scratch)
        if not args.skip_70b:
            bench_70b(args, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
