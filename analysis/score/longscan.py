"""Long-context results, measured once and kept on disk: the entry points the CLI and the app share (issue 46).

- `stored_scan(loaded, built, ...)`: the shared dense pass (analysis.measure.longpass.long_scan: the long-context
  probes `built` with the retrieval and streaming scores read from the same passes), stored under the model's
  fingerprint, the probes' items (their digest: tokenizer, seed, lengths, depths, sequences, BOS), the window,
  the query rows, the bootstrap seed, the precision and the code (analysis.arch.stored.remembered). `dense_of`
  gives its probes' dense side keyed as analysis.score.longcontext.long_context_report's `dense=` takes it.
- `stored_detections(loaded, names, options)`: the long detectors (retrieval, streaming) on their own rows
  (`roles --detector retrieval`, the Heads page), one stored result per detector and options.
- `stored_importance(loaded, tokens)`: the KV groups' ablation a KV plan prunes by (analysis.score.kvscores.
  group_importance), stored per tokens.

Every one returns (value, analysis.core.store.Lookup): `lookup.hit` says it came from disk.
"""
from __future__ import annotations

from analysis.arch.stored import remembered
from analysis.arch.window import Window, window_of
from analysis.measure.headmaps import Detection
from analysis.measure.long_options import DEFAULT_QUERIES
from analysis.measure.longpass import SCAN_MODULES, LongScan, long_scan
from analysis.score.longcontext import items_key

SCAN = "long-scan"
IMPORTANCE = "kv-importance"
DETECTOR = "detector-{}"
MEASURES = (SCAN, IMPORTANCE, DETECTOR.format("retrieval"), DETECTOR.format("streaming"))
DETECTOR_MODULES = ("analysis.measure.longheads", "analysis.measure.long_options", "analysis.measure.detectors",
                    "analysis.measure.detector_registry", "analysis.measure.haystack", "analysis.measure.headmaps",
                    "analysis.core.text", "analysis.arch.spans", "analysis.arch.window", "analysis.score.longscan")
IMPORTANCE_MODULES = ("analysis.measure.ablation", "analysis.measure.loss", "analysis.measure.evaluation",
                      "analysis.arch.head_gates", "analysis.core.text", "analysis.score.kvscores",
                      "analysis.score.longscan")


def scan_settings(built: dict, *, window: Window, queries: int, seed: int, precision: str) -> dict:
    """What a stored scan is of, besides the model and the code: its probes' items (by digest), the window and
    query rows of the streaming reads, the bootstrap seed, the precision."""
    return dict(items=[[name, length, items_key(name, length, items)[2]] for (name, length), (_, _, items)
                       in built.items()],
                window=window_of(window).as_dict(), queries=int(queries), seed=int(seed), precision=precision)


def stored_scan(loaded, built: dict, *, window: Window = Window(), queries: int = DEFAULT_QUERIES, seed: int = 0,
                precision: str = "float32", progress=None, should_stop=None, store=None, refresh: bool = False,
                on_refused=None):
    """(LongScan, Lookup): the scan of `built` on `loaded`'s dense model, from the store or measured and stored."""
    window = window_of(window)
    settings = scan_settings(built, window=window, queries=queries, seed=seed, precision=precision)

    def compute() -> LongScan:
        return long_scan(loaded.model, built, window=window, queries=queries, seed=seed, precision=precision,
                         progress=progress, should_stop=should_stop)

    return remembered(loaded, SCAN, settings, compute, modules=SCAN_MODULES, to_tree=LongScan.to_tree,
                      from_tree=LongScan.from_tree, store=store, refresh=refresh, on_refused=on_refused)


def dense_of(scan: LongScan, built: dict) -> dict:
    """The scan's probes' dense side keyed by the items' digest (long_context_report's `dense=`)."""
    return {items_key(name, length, built[(name, length)][2]): scores
            for (name, length), scores in scan.dense(built).items()}


# -- detections ----------------------------------------------------------------------------------------

def detection_tree(det: Detection) -> dict:
    return dict(name=det.name, scores=det.scores, threshold=float(det.threshold), unit=det.unit, extras=det.extras)


def detection_of_tree(tree: dict) -> Detection:
    import numpy as np
    scores = np.asarray(tree["scores"], dtype=np.float64)
    if scores.ndim != 2 or not isinstance(tree["extras"], dict):
        raise ValueError("a stored detection's scores are not [layers, heads]")
    return Detection(str(tree["name"]), scores, float(tree["threshold"]), str(tree["unit"]), dict(tree["extras"]))


def stored_detections(loaded, names, options: dict | None = None, *, progress=None, should_stop=None, store=None,
                      refresh: bool = False, on_refused=None) -> tuple[dict, dict]:
    """({name: Detection}, {name: Lookup}) of the long detectors `names` (retrieval, streaming) on their own rows
    with `options` (analysis.measure.detectors.detect_heads' options), each from the store or measured and
    stored; the lengths the detector resolves on this model are part of the key."""
    from analysis.core.progress import scaled
    from analysis.measure.detectors import detect_heads, get_detector
    names = list(names)
    out, found = {}, {}
    for i, name in enumerate(names):
        det = get_detector(name, loaded.tokenizer, **(options or {}))
        settings = dict(options=dict(sorted((options or {}).items())), passes=det.passes(loaded.model))
        part = scaled(progress, i / len(names), (i + 1) / len(names))

        def compute(name=name, part=part):
            return detect_heads(loaded, [name], options=options, progress=part, should_stop=should_stop)[name]

        out[name], found[name] = remembered(loaded, DETECTOR.format(name), settings, compute, modules=DETECTOR_MODULES,
                                            to_tree=detection_tree, from_tree=detection_of_tree, store=store,
                                            refresh=refresh, on_refused=on_refused)
    return out, found


def stored_importance(loaded, tokens: int, *, progress=None, should_stop=None, store=None, refresh: bool = False,
                      on_refused=None):
    """([L, Hkv] loss increase per removed KV group, Lookup) on `tokens` tokens of the built-in evaluation text."""
    import numpy as np

    from analysis.score.kvscores import group_importance

    def compute():
        return group_importance(loaded, tokens, progress=progress, should_stop=should_stop)

    def of_tree(t):
        a = np.asarray(t, dtype=np.float64)
        if a.shape != (loaded.geometry.n_layers, loaded.geometry.n_kv_heads):
            raise ValueError("a stored importance of another shape")
        return a

    return remembered(loaded, IMPORTANCE, dict(tokens=int(tokens)), compute, modules=IMPORTANCE_MODULES,
                      from_tree=of_tree, store=store, refresh=refresh, on_refused=on_refused)


__all__ = ["stored_scan", "dense_of", "stored_detections", "stored_importance", "scan_settings", "SCAN",
           "IMPORTANCE", "DETECTOR", "MEASURES", "detection_tree", "detection_of_tree"]
