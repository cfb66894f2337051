"""Long-context results, measured once and kept on disk: the entry points the CLI and the app share (issue 46).

- `stored_scan(loaded, built, ...)`: the shared dense pass (analysis.measure.longpass.long_scan: the long-context
  probes `built` with the retrieval and streaming scores read from the same passes), stored under the model's
  fingerprint, the probes' items (their digest: tokenizer, seed, lengths, depths, sequences, BOS), the window,
  the query rows, the bootstrap seed, the precision and the code (analysis.arch.stored.remembered). `dense_of`
  gives its probes' dense side keyed as analysis.score.longcontext.long_context_report's `dense=` takes it.
- `stored_detections(loaded, names, options)`: the long detectors (retrieval, streaming, retrieval-aware) on their
  own rows (`roles --detector retrieval`, the Heads page, kv-plan), one stored result per detector and its
  effective settings.
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
DENSE = "long-dense"                 # the probes' dense side of a scan, apart (no window changes it)
IMPORTANCE = "kv-importance"
DETECTOR = "detector-{}"
MEASURES = (SCAN, DENSE, "long-cut", IMPORTANCE, DETECTOR.format("retrieval"), DETECTOR.format("streaming"))
DETECTOR_MODULES = ("analysis.measure.longheads", "analysis.measure.retrieval_aware", "analysis.measure.ablation",
                    "analysis.measure.long_options", "analysis.measure.detectors",
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
                on_refused=None, compute: bool = True, fingerprint: str | None = None):
    """(LongScan, Lookup): the scan of `built` on `loaded`'s dense model, from the store or measured and stored
    (with its probes' dense side as a record of its own, `stored_dense`'s, which no window changes). compute
    False: only look (None unless stored). fingerprint: the model's, when the caller has it."""
    from analysis.arch.stored import model_fingerprint
    from analysis.core.store import Key, Store, code_digest
    window = window_of(window)
    store = store or Store()
    fingerprint = fingerprint or model_fingerprint(loaded)
    settings = scan_settings(built, window=window, queries=queries, seed=seed, precision=precision)

    def measure() -> LongScan:
        scan = long_scan(loaded.model, built, tokenizer=loaded.tokenizer, window=window, queries=queries, seed=seed,
                         precision=precision, progress=progress, should_stop=should_stop)
        store.put(Key(fingerprint, DENSE, dense_settings(built, seed=seed, precision=precision),
                      code_digest(SCAN_MODULES)), values_tree(scan), about=about(loaded, scan.total_seconds))
        return scan

    return remembered(loaded, SCAN, settings, measure if compute else None, modules=SCAN_MODULES,
                      to_tree=LongScan.to_tree, from_tree=LongScan.from_tree, store=store, refresh=refresh,
                      on_refused=on_refused, fingerprint=fingerprint)


def about(loaded, seconds: float) -> dict:
    """What a stored result says about itself besides its key (remember's words): the model's name, when, how long."""
    import time
    return dict(model_name=str(loaded.name), seconds=round(float(seconds), 3), stored=time.strftime("%Y-%m-%d %H:%M:%S"))


def dense_settings(built: dict, *, seed: int, precision: str) -> dict:
    """What the probes' dense side is of: the items (by digest), the bootstrap seed, the precision."""
    settings = scan_settings(built, window=Window(), queries=1, seed=seed, precision=precision)
    return {k: settings[k] for k in ("items", "seed", "precision")}


def values_tree(scan: LongScan) -> dict:
    """The probes' part of a scan: their item values (diff, nll), seconds and generated answers per (name, length)."""
    n = range(len(scan.keys))
    return side_tree(scan.keys, [(*scan.values[k], scan.seconds.get(k, 0.0), scan.written.get(k)) for k in n])


def side_tree(keys, values) -> dict:
    """One side of the probes as stored: per (name, length) its item values (diff, nll [1, n]), seconds and each
    row's generated answer (None: not generated)."""
    return dict(keys=[list(k) for k in keys], values=[[v[0], v[1]] for v in values],
                seconds=[float(v[2]) for v in values],
                written=[None if v[3] is None else list(v[3]) for v in values])


def stored_dense(loaded, built: dict, *, seed: int = 0, precision: str = "float32", compute: bool = True,
                 window: Window = Window(), queries: int = DEFAULT_QUERIES, progress=None, should_stop=None,
                 store=None, refresh: bool = False, on_refused=None, fingerprint: str | None = None):
    """(items_key -> {depth label: ProbeScore}, Lookup): the probes' dense side of `built` (long_context_report's
    `dense=`), read back when any scan of these items stored it, else (`compute`) measured by a scan with
    `window` / `queries` (which stores the scan too); None with the Lookup of a miss when not `compute`."""
    from analysis.arch.stored import model_fingerprint
    from analysis.core.store import Key, Lookup, Store, code_digest
    from analysis.measure.probes.longcontext import long_scores
    store = store or Store()
    fingerprint = fingerprint or model_fingerprint(loaded)
    key = Key(fingerprint, DENSE, dense_settings(built, seed=seed, precision=precision), code_digest(SCAN_MODULES))
    got, found = _read_back(store, key, built, lambda values: {
        items_key(name, length, built[(name, length)][2]):
        long_scores(*built[(name, length)], diff, nll, seed=seed, seconds=seconds, written=written)
        for (name, length), (diff, nll, seconds, written) in values.items()}, refresh=refresh, on_refused=on_refused)
    if got is not None or not compute:
        return got, found
    scan, seen = stored_scan(loaded, built, window=window, queries=queries, seed=seed, precision=precision,
                             progress=progress, should_stop=should_stop, store=store, refresh=refresh,
                             on_refused=on_refused, fingerprint=fingerprint)
    return dense_of(scan, built), seen


def dense_of(scan: LongScan, built: dict) -> dict:
    """The scan's probes' dense side keyed by the items' digest (long_context_report's `dense=`)."""
    return {items_key(name, length, built[(name, length)][2]): scores
            for (name, length), scores in scan.dense(built).items()}


CUT = "long-cut"                     # a cut's side of the long-context probes (a mask's or a KV plan's)
CUT_MODULES = SCAN_MODULES + ("analysis.score.longcontext", "analysis.arch.cut", "analysis.arch.kvplan",
                              "analysis.arch.kvcache", "analysis.arch.head_gates")


def stored_report(loaded, built: dict, cut, *, dense: dict, seed: int = 0, precision: str = "float32",
                  compute: bool = True, progress=None, should_stop=None, per_row: dict | None = None, store=None,
                  refresh: bool = False, on_refused=None, fingerprint: str | None = None):
    """(LongContextReport | None, Lookup) of the probes `built` dense (`dense`: their dense side) vs `cut`, the cut's
    item values read back when this machine stored them for this model, these items and this cut (a mask's or a
    KV plan's contents: Cut.key), else measured (run the call inside the cut's precision: longpass.precision_block)
    and stored. A model of its own is measured each time (its weights are not a stored key). compute False: only
    look."""
    from analysis.arch.stored import model_fingerprint
    from analysis.core.store import Key, Lookup, Store, code_digest
    from analysis.score.longcontext import long_context_report
    if cut is None or cut.kind == "model":
        if not compute:
            return None, Lookup("miss")
        return long_context_report(loaded, built=built, dense=dense, cut=cut, seed=seed, per_row=per_row,
                                   progress=progress, should_stop=should_stop), Lookup("miss")
    store = store or Store()
    settings = dict(dense_settings(built, seed=seed, precision=precision), cut=cut.key(), kind=cut.kind)
    key = Key(fingerprint or model_fingerprint(loaded), CUT, settings, code_digest(CUT_MODULES))
    got, found = _read_back(store, key, built, lambda values: long_context_report(
        loaded, built=built, dense=dense, cut=cut, seed=seed, cut_values=values), refresh=refresh,
        on_refused=on_refused)
    if got is not None or not compute:
        return got, found
    report = long_context_report(loaded, built=built, dense=dense, cut=cut, seed=seed, per_row=per_row,
                                 progress=progress, should_stop=should_stop)
    keys = list(built)
    store.put(key, side_tree(keys, [report.cut_values[k] for k in keys]), about=about(loaded, report.seconds))
    return report, found


def _read_back(store, key, built: dict, make, *, refresh: bool, on_refused) -> tuple:
    """(make(the probes' per-row values stored under `key`), Lookup), or (None, Lookup) on a miss; a file whose
    values do not fit `built` is "corrupt". A corrupt or foreign file is reported to `on_refused`."""
    from analysis.core.store import Lookup
    found = Lookup("miss") if refresh else store.get(key)
    if found.hit:
        try:
            return make(_values_of(found.value, built)), found
        except (KeyError, ValueError, TypeError) as err:
            found = Lookup("corrupt", path=found.path, why=f"its values do not fit these probes ({err})")
    if found.status in ("corrupt", "foreign") and on_refused is not None:
        on_refused(found)
    return None, found


def _values_of(tree: dict, built: dict) -> dict:
    """(name, length) -> (diff [1, n], nll [1, n], seconds, written) of a stored side (`side_tree`), checked against
    `built`."""
    import numpy as np
    out = {}
    for (name, length), (diff, nll), seconds, written in zip(tree["keys"], tree["values"], tree["seconds"],
                                                             tree["written"]):
        key = (str(name), int(length))
        items = built[key][2]
        diff, nll = np.asarray(diff, dtype=np.float64), np.asarray(nll, dtype=np.float64)
        if diff.shape != (1, items.correct.numel()) or nll.shape != diff.shape:
            raise ValueError("stored item values of another size")
        if written is not None and len(written) != items.ids.shape[0]:
            raise ValueError("stored generated answers of another number of rows")
        out[key] = (diff, nll, float(seconds), None if written is None else tuple(str(w) for w in written))
    if set(out) != set(built):
        raise ValueError("it holds other probes")
    return out


# -- detections ----------------------------------------------------------------------------------------

def detection_tree(det: Detection) -> dict:
    return dict(name=det.name, scores=det.scores, threshold=float(det.threshold), unit=det.unit, extras=det.extras)


def detection_of_tree(tree: dict) -> Detection:
    import numpy as np
    scores = np.asarray(tree["scores"], dtype=np.float64)
    if scores.ndim != 2 or not isinstance(tree["extras"], dict):
        raise ValueError("a stored detection's scores are not [layers, heads]")
    return Detection(str(tree["name"]), scores, float(tree["threshold"]), str(tree["unit"]), dict(tree["extras"]))


def detector_settings(det, model) -> dict:
    """A long detector's effective settings (its own attributes: the options it took and the defaults it kept, the
    window as sinks and recent) and the passes it runs on `model` (its lengths resolved against the context): the
    same measurement asked with other words (kv-plan's options, roles') is one stored result."""
    out = {k: (v.as_dict() if isinstance(v, Window) else v) for k, v in sorted(vars(det).items()) if k != "tokenizer"}
    return dict(out, detector=det.name, passes=det.passes(model))


def stored_detections(loaded, names, options: dict | None = None, *, progress=None, should_stop=None, store=None,
                      refresh: bool = False, on_refused=None, compute: bool = True) -> tuple[dict, dict]:
    """({name: Detection}, {name: Lookup}) of the long detectors `names` (retrieval, streaming) on their own rows
    with `options` (analysis.measure.detectors.detect_heads' options), each from the store or measured and
    stored; the lengths the detector resolves on this model are part of the key. compute False: only look (None
    for a detection not stored)."""
    from analysis.core.progress import scaled
    from analysis.measure.detectors import detect_heads, get_detector
    names = list(names)
    out, found = {}, {}
    for i, name in enumerate(names):
        det = get_detector(name, loaded.tokenizer, **(options or {}))
        settings = detector_settings(det, loaded.model)
        part = scaled(progress, i / len(names), (i + 1) / len(names))

        def measure(name=name, part=part):
            return detect_heads(loaded, [name], options=options, progress=part, should_stop=should_stop)[name]

        out[name], found[name] = remembered(loaded, DETECTOR.format(name), settings, measure if compute else None,
                                            modules=DETECTOR_MODULES, to_tree=detection_tree,
                                            from_tree=detection_of_tree, store=store, refresh=refresh,
                                            on_refused=on_refused)
    return out, found


def stored_importance(loaded, tokens: int, *, precision: str = "float32", progress=None, should_stop=None,
                      store=None, refresh: bool = False, on_refused=None, compute: bool = True,
                      fingerprint: str | None = None):
    """([L, Hkv] loss increase per removed KV group, Lookup) on `tokens` tokens of the built-in evaluation text, its
    passes in `precision` (analysis.measure.longpass.precision_block; compute False: only look)."""
    import numpy as np

    from analysis.score.kvscores import group_importance

    def measure():
        from analysis.measure.longpass import precision_block
        with precision_block(loaded.model, precision):
            return group_importance(loaded, tokens, progress=progress, should_stop=should_stop)

    def of_tree(t):
        a = np.asarray(t, dtype=np.float64)
        if a.shape != (loaded.geometry.n_layers, loaded.geometry.n_kv_heads):
            raise ValueError("a stored importance of another shape")
        return a

    settings = dict(tokens=int(tokens)) if precision == "float32" else dict(tokens=int(tokens), precision=precision)
    return remembered(loaded, IMPORTANCE, settings, measure if compute else None,
                      modules=IMPORTANCE_MODULES, from_tree=of_tree, store=store, refresh=refresh,
                      on_refused=on_refused, fingerprint=fingerprint)


# -- a KV plan's scores (`headscope kv-plan`), each part stored ------------------------------------------------

ROWS = ("own", "probes")             # where kv-plan reads the streaming and retrieval scores


def page_rows(loaded, lengths=None, depths=None, *, probes=None, n_items: int | None = None, seed: int = 0,
              bos: str = "auto", split: str = "test") -> dict:
    """The long-context probes' rows the Long context page reads (its defaults: analysis.measure.long_options
    PAGE_*), at `lengths` (default: PAGE_LENGTH clipped to the model's context), of `split`: test rows (what its
    verdicts read) or calibration rows (what its heads' scores read: splits.SCORE_SPLIT)."""
    from analysis.measure.evaluation import context_length
    from analysis.measure.long_options import DEFAULT_DEPTHS, PAGE_LENGTH, PAGE_PROBES, PAGE_SEQUENCES
    from analysis.measure.probes.longcontext import build_long
    limit = context_length(loaded)
    return build_long(list(probes or PAGE_PROBES), loaded.tokenizer, loaded.kind, lengths or (min(PAGE_LENGTH, limit),),
                      depths=depths or DEFAULT_DEPTHS, n_items=n_items or PAGE_SEQUENCES, seed=seed, bos=bos,
                      limit=limit, split=split)


def stored_kv_scores(loaded, *, rows: str = "own", window: Window = Window(), lengths=None, retrieval_lengths=None,
                     depths=None, needles: int | None = None, queries: int = DEFAULT_QUERIES, retrieval: bool = True,
                     prune: bool = False, prune_tokens: int | None = None, window_score: str = "streaming",
                     seed: int = 0, precision: str = "float32", progress=None, should_stop=None, store=None,
                     refresh: bool = False, on_refused=None):
    """(analysis.score.kvscores.KVScores, {part: Lookup}): what a KV plan is made from (measure_kv_scores' parts),
    each from the store or measured and stored. rows "own": each detector on its own rows (the window score's,
    the retrieval score's needle items: measure_kv_scores' numbers); rows "probes": the streaming and retrieval
    scores from one shared scan of the long-context probes' calibration rows (the Long context page's scores:
    `page_rows` at `lengths`, split SCORE_SPLIT, apart from the probe rows a verdict reads), a retrieval-aware
    window score on its own rows."""
    import time

    from analysis.core.errors import InputError
    from analysis.core.progress import scaled
    from analysis.measure.long_options import DEFAULT_DEPTHS, DEFAULT_NEEDLES, PAGE_IMPORTANCE_TOKENS
    from analysis.score.kvscores import KVScores, check_window_score
    if rows not in ROWS:
        raise InputError(f"The KV scores' rows are one of {', '.join(ROWS)}; got {rows!r}.")
    check_window_score(window_score)
    window = window_of(window)
    geo = loaded.geometry
    out = KVScores()
    found: dict = {}
    share = 1.0 / (1 + bool(prune))
    own = dict(lengths=lengths, depths=depths or DEFAULT_DEPTHS, needles=needles or DEFAULT_NEEDLES, queries=queries,
               seed=seed, **window.as_dict())
    options = {window_score: own, "retrieval": dict(lengths=retrieval_lengths or lengths, depths=own["depths"],
                                                    needles=own["needles"], seed=seed)}
    dets = {}
    if rows == "probes":
        t0 = time.perf_counter()
        from analysis.measure.splits import SCORE_SPLIT
        built = page_rows(loaded, lengths, depths, seed=seed, split=SCORE_SPLIT)
        scan, found["scan"] = stored_scan(loaded, built, window=window, queries=queries, seed=seed,
                                          precision=precision, progress=scaled(progress, 0.0, share / 2),
                                          should_stop=should_stop, store=store, refresh=refresh, on_refused=on_refused)
        dets = {"streaming": scan.streaming(), "retrieval": scan.retrieval()}
        out.seconds["scan"] = time.perf_counter() - t0
    elif precision != "float32":
        raise InputError("The detectors' own rows are measured in float32; bfloat16 is for the shared scan "
                         "(rows 'probes').")
    names = [n for n in dict.fromkeys([window_score] + (["retrieval"] if retrieval else [])) if n not in dets]
    for i, name in enumerate(names):
        part = scaled(progress, share * (i + 1) / (len(names) + 1), share * (i + 2) / (len(names) + 1))
        t0 = time.perf_counter()
        got, seen = stored_detections(loaded, [name], options[name], progress=part, should_stop=should_stop,
                                      store=store, refresh=refresh, on_refused=on_refused)
        dets[name], found[name] = got[name], seen[name]
        out.seconds[name] = time.perf_counter() - t0
    out.with_window_score(window_score, dets[window_score].extras["kv_scores"])
    out.detections[window_score] = dets[window_score]
    if retrieval:
        out.retrieval = dets["retrieval"].extras["kv_scores"]
        out.detections["retrieval"] = dets["retrieval"]
    if prune:
        t0 = time.perf_counter()
        tokens = int(prune_tokens or PAGE_IMPORTANCE_TOKENS)
        out.importance, found["importance"] = stored_importance(loaded, tokens, precision=precision,
                                                                progress=scaled(progress, share, 1.0),
                                                                should_stop=should_stop, store=store,
                                                                refresh=refresh, on_refused=on_refused)
        out.prune_tokens = tokens
        out.seconds["importance"] = time.perf_counter() - t0
    if out.window_score(window_score).shape != (geo.n_layers, geo.n_kv_heads):
        raise InputError("The stored window scores do not fit this model's KV heads.")
    return out, found


# -- what the passes cost (the app's estimates, the bench) ------------------------------------------------------

def importance_ablations(geometry) -> int:
    """The ablations group_importance runs per layer (one batch of the fast sweep): the Hkv groups on a GQA model,
    the H heads on an MHA one."""
    return geometry.n_kv_heads if geometry.group_size > 1 else geometry.n_heads


def head_fraction(model) -> float:
    """The language-model head's share of a forward's cost per token: its weights over the decoder layers' (the
    multiply-adds of both grow with them)."""
    from analysis.arch.adapters import adapter_for
    head = model.get_output_embeddings()
    layers = adapter_for(model).layers(model)
    stack = sum(p.numel() for layer in layers for p in layer.parameters())
    return float(head.weight.numel()) / max(1, stack) if head is not None else 0.0


def importance_seconds(geometry, tokens: int, row_at_tokens: float, head_share: float = 0.0) -> float:
    """Predicted seconds of the KV groups' ablation (analysis.measure.ablation's fast sweep): for each of the
    `importance_ablations` of layer l it replays the layers from l on, about (L + 1) / 2 layers on average, and
    reads the loss through the LM head at every one of the `tokens` positions (`head_share` of a forward: see
    `head_fraction`; 27 % on SmolLM2), plus one dense pass; `row_at_tokens`: this machine's seconds for one row of
    `tokens` tokens, timed in batches of the ablations' number (analysis.measure.probes.longcontext.row_seconds
    with rows=...: one logit a row, so without the head)."""
    g = geometry
    per_ablation = (g.n_layers + 1) / 2 + g.n_layers * head_share        # rows' worth of work, per layer swept
    return (importance_ablations(g) * per_ablation + 1 + head_share) * float(row_at_tokens)


__all__ = ["importance_seconds", "importance_ablations", "head_fraction", "stored_scan", "stored_dense", "stored_report", "CUT", "dense_settings", "values_tree", "DENSE", "dense_of", "stored_detections", "stored_importance", "stored_kv_scores", "page_rows",
           "ROWS", "scan_settings", "SCAN",
           "IMPORTANCE", "DETECTOR", "MEASURES", "detection_tree", "detection_of_tree"]
