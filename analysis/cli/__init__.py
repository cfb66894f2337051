"""Headless command line: `python -m analysis <command> ...` with JSON or CSV output.

Commands built in here:
    score   scores of one scorer for every head           (JSON: metadata + [L, H] scores; CSV: layer,head,score)
    mask    the mask at a sparsity, with its summary      (CSV: layer,head,score,rank,pruned)
    sweep   MP / MP-G metric vs z at a fixed sparsity     (CSV: one row per z)
    ablate  single-head (and KV-group) ablation sweep     (CSV: layer,head,kv_group,delta,group_delta)
    evaluate  perplexity (or the kind's metric) dense and under the mask
    export  the pruned model in one of four formats, plus mask.json
    pipeline  iterative prune -> distill -> INT8 with a compression report (analysis/compress/pipeline.py)

Sources: `--model` (a built-in name, a local folder or a hub id in the local cache) loads the
model; `--checkpoint DIR` profiles a safetensors checkpoint by streaming, without building
the model (weight-only scorers only: those registered with needs_calibration = False).

Scorers come from `analysis.score.scoring.SCORERS`: --scorer's choices, and one option per
constructor parameter of any registered scorer (`SCORER_OPTION_SPECS` gives the built-in
parameters their help and choices; a new parameter gets `--its-name` typed from its default).

Commands: `register(name, help, add_arguments, run)`; `run(namespace) -> (payload, rows)` where
payload is JSON-able and rows (a list of dicts, or None) is what --format csv prints.

Progress bars go to stderr (tqdm), results to stdout or --out; user errors print one line
and exit with status 2. --out is checked before any work and written atomically
(`analysis.core.atomic`): a full disk or a kill never leaves a truncated file or destroys the old one.
SIGTERM is handled like Ctrl-C (temporary files and folders are removed; exit status 130).
Custom model code runs only with --trust-remote-code; transformers never prompts for it.

Multi-process (`accelerate launch --multi_gpu --num_processes N -m analysis <command> ...` or torchrun;
docs/DISTRIBUTED.md): commands registered with distributed=True (score, mask, sweep, evaluate,
ablate) split their forward passes over the processes (analysis.core.distributed) and give the
single-process numbers; the other commands run on rank 0 alone. Only rank 0 draws progress and
writes the result; a lost process ends the run with one error line.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm

from analysis.core import distributed
from analysis.core.atomic import atomic_write, check_output_file
from analysis.core.errors import HeadscopeError, InputError, first_line
from analysis.score.masks import KV_POLICIES, POLICIES, plan_mask, summarize_mask
from analysis.measure.profiles import DEFAULT_STD, DEFAULT_Z, ORDS, SCOPES, STD_DDOF

_STD_HELP = ("std in tau = mean + z * std: population (ddof 0, the default) or sample (ddof 1, PyTorch's "
             "Tensor.std)")

# scorer constructor parameter -> (flags, add_argument options); the option's dest is the parameter
SCORER_OPTION_SPECS = {
    "z": (("--z",), dict(type=float, default=DEFAULT_Z, help="MP threshold (mean + z * std)")),
    "scope": (("--scope",), dict(choices=SCOPES, default="layer", help="threshold population")),
    "ord": (("--ord",), dict(type=int, choices=ORDS, default=2, help="row norm: 2 (L2) or 1 (L1)")),
    "std": (("--std",), dict(choices=tuple(STD_DDOF), default=None, help=_STD_HELP)),
    "a_q": (("--a-q",), dict(type=float, default=None, help="MP-G weight of Q/O excess")),
    "a_kv": (("--a-kv",), dict(type=float, default=None, help="MP-G weight of K/V excess")),
    "seed": (("--seed",), dict(type=int, default=None, help="random scorer seed")),
    "n_sequences": (("--n-sequences",), dict(type=int, default=None, help="calibration sequences (calibration scorers)")),
    "seq_len": (("--seq-len",), dict(type=int, default=None, help="calibration sequence length")),
    "batch_size": (("--batch-size",), dict(type=int, default=None)),
    "n_steps": (("--n-steps",), dict(type=int, default=None, help="integrated-gradient steps")),
    "damping": (("--damping",), dict(type=float, default=None, help="SparseGPT damping fraction")),
    "normalize": (("--normalize",), dict(default=None, help="wanda / sparsegpt: 'layer' divides each layer's "
                                                            "scores by that layer's mean (default none)")),
}

Runner = Callable[[argparse.Namespace], tuple[object, list | None]]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Runner
    distributed: bool = False    # splits its work over the processes of a launch (ns.team); else rank 0 alone


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None], run: Runner,
             distributed: bool = False) -> None:
    """Add a subcommand. distributed=True: `run` passes ns.team (analysis.core.distributed.Team) to the work."""
    COMMANDS[name] = Command(name, help, add_arguments, run, distributed)


def team_of(ns: argparse.Namespace) -> distributed.Team:
    """The processes this command runs on (SOLO outside a launch)."""
    return getattr(ns, "team", None) or distributed.SOLO


# ---------------------------------------------------------------------------------------------
# Progress and output
# ---------------------------------------------------------------------------------------------


@contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[Callable[[float, str], None]]:
    """A progress(fraction, message) callback drawing a tqdm bar on stderr; closed in finally."""
    bar = tqdm(total=1000, desc=description, file=sys.stderr, disable=not enabled, leave=False,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")

    def report(fraction: float, message: str) -> None:
        bar.n = int(1000 * min(max(fraction, 0.0), 1.0))
        bar.set_postfix_str(message[:60], refresh=False)
        bar.refresh()

    try:
        yield report
    finally:
        bar.close()


def to_jsonable(value):
    """numpy / nested containers -> plain JSON types."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def render(payload, rows: list | None, fmt: str) -> str:
    """JSON of the payload, or CSV of the rows."""
    if fmt == "json":
        return json.dumps(to_jsonable(payload), indent=2) + "\n"
    if not rows:
        raise InputError("This command has no table to write as CSV; use --format json.")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(to_jsonable(rows))
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Shared options and sources
# ---------------------------------------------------------------------------------------------


def add_source_arguments(parser: argparse.ArgumentParser, streaming: bool = True) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--model", default=None,
                       help="built-in name (smollm2-135m, minilm-l6), local folder or cached hub id "
                            "(default: smollm2-135m)")
    if streaming:
        group.add_argument("--checkpoint", default=None,
                           help="safetensors checkpoint folder to profile by streaming (weight-only scorers)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code")
    parser.add_argument("--cache-dir", default=None, help="headscope cache folder for built-ins")
    add_placement_arguments(parser)


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Device, dtype and accelerate placement of the loaded model (checked by analysis/core/placement.py,
    so a bad value is one clear line, not an argparse usage dump)."""
    group = parser.add_argument_group("placement")
    group.add_argument("--device", default="auto",
                       help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N or mps")
    group.add_argument("--dtype", default="auto",
                       help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    group.add_argument("--device-map", dest="device_map", default=None,
                       help="auto: let accelerate spread the model over the GPUs, the CPU and the disk")
    group.add_argument("--max-memory", dest="max_memory", default=None,
                       help='per-device budgets for --device-map auto, e.g. "0=20GiB,cpu=8GiB" (implies it)')
    group.add_argument("--offload-folder", dest="offload_folder", default=None,
                       help="folder for weights that fit nowhere else (disk offload; implies --device-map auto)")


def placement_kwargs(ns: argparse.Namespace) -> dict:
    """load_model keywords from the placement options (defaults when a parser lacks them)."""
    return dict(device=getattr(ns, "device", "auto"), dtype=getattr(ns, "dtype", "auto"),
                device_map=getattr(ns, "device_map", None), max_memory=getattr(ns, "max_memory", None),
                offload_folder=getattr(ns, "offload_folder", None))


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("json", "csv"), default="json")
    parser.add_argument("--out", default=None, help="write here instead of stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def scorer_option_defaults() -> dict[str, object]:
    """{parameter: default} over the constructors of every registered scorer (the CLI's scorer options).

    Parameters with a None default and no spec (array inputs such as the oracle's loss_increase)
    have no option."""
    from analysis.score.scoring import SCORERS, scorer_parameters

    out = {}
    for name in SCORERS:
        for param, default in scorer_parameters(name).items():
            if param in SCORER_OPTION_SPECS or default is not None:
                out.setdefault(param, default)
    return out


def add_scorer_arguments(parser: argparse.ArgumentParser, choices=None, default: str | None = None) -> None:
    from analysis.score.scoring import SCORERS

    parser.add_argument("--scorer", choices=choices or tuple(SCORERS), default=default,
                        help="default: mp-g on GQA/MQA models, mp on MHA models (equal there)")
    for param, default in scorer_option_defaults().items():
        flags, options = SCORER_OPTION_SPECS.get(param, ((f"--{param.replace('_', '-')}",),
                                                          dict(type=type(default), default=None)))
        parser.add_argument(*flags, dest=param, **options)
    parser.add_argument("--ablation-file", default=None,
                        help="JSON or .npy [layers, heads] loss increases for --scorer ablation")


def scorer_from(ns: argparse.Namespace):
    """Build the chosen scorer from the options its constructor accepts."""
    from analysis.score.scoring import get_scorer, scorer_parameters

    kwargs = {param: getattr(ns, param) for param in scorer_parameters(ns.scorer)
              if getattr(ns, param, None) is not None}
    if ns.scorer == "ablation" and getattr(ns, "ablation_file", None):
        kwargs["loss_increase"] = read_array(ns.ablation_file)
    return get_scorer(ns.scorer, **kwargs)


ARRAY_FILE_MAX_BYTES = 64 * 2**20   # a [L, H] table of numbers is far smaller


def read_array(path: str) -> np.ndarray:
    """A finite [L, H] float array from a .npy or JSON file (a list of lists, or {"head_delta": ...})."""
    fix = ("Give a .npy file or a JSON list of lists of numbers, one row per layer "
           "(e.g. the head_delta of an ablation run).")
    try:
        if Path(path).stat().st_size > ARRAY_FILE_MAX_BYTES:
            raise InputError(f"--ablation-file {path} is larger than {ARRAY_FILE_MAX_BYTES // 2**20} MiB, far more "
                             f"than a [layers, heads] table. {fix}")
        if path.endswith(".npy"):
            arr = np.load(path, allow_pickle=False)
        else:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            arr = data.get("head_delta", data.get("scores")) if isinstance(data, dict) else data
        arr = np.asarray(arr, dtype=np.float64)
    except (OSError, ValueError, TypeError, RecursionError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)
        raise InputError(f"Could not read --ablation-file {path} ({reason}). {fix}") from None
    if arr.ndim != 2 or not arr.size:
        raise InputError(f"--ablation-file {path} holds an array of shape {list(arr.shape)}, not a [layers, heads] "
                         f"table. {fix}")
    if not np.isfinite(arr).all():
        raise InputError(f"--ablation-file {path} holds NaN or infinite values. {fix}")
    return arr


def load_source(ns: argparse.Namespace, report):
    """(target for scoring, LoadedModel or None, geometry-ish info dict) for --model / --checkpoint."""
    for option in ("model", "checkpoint"):
        value = getattr(ns, option, None)
        if value is not None and not value.strip():
            raise InputError(f"--{option} is empty; give a built-in name (smollm2-135m, minilm-l6), a folder or a "
                             f"hub id, or leave the option out for the default model.")
    if getattr(ns, "checkpoint", None):
        from analysis.arch.adapters import adapter_for
        from analysis.arch.checkpoint import checkpoint_folder, load_config
        from analysis.measure.streaming import profile_checkpoint

        trust = ns.trust_remote_code
        config = load_config(checkpoint_folder(ns.checkpoint), trust_remote_code=trust)
        geometry = adapter_for(config).geometry(config)
        profile = profile_checkpoint(ns.checkpoint, progress=report, trust_remote_code=trust)
        return profile, None, dict(source=ns.checkpoint, **geometry.as_dict())
    from analysis.arch.models import DEFAULT_MODEL, load_model

    loaded = load_model(ns.model or DEFAULT_MODEL, trust_remote_code=ns.trust_remote_code,
                        cache_dir=ns.cache_dir, progress=report, **placement_kwargs(ns))
    return loaded, loaded, dict(source=loaded.name, kind=loaded.kind, placement=loaded.placement.describe(),
                                **loaded.geometry.as_dict())


def resolve_scorer(ns: argparse.Namespace, group_size: int) -> str:
    """--scorer, or the model's default (analysis.score.scoring.default_scorer) when it was not given."""
    from analysis.score.scoring import default_scorer

    if ns.scorer is None:
        ns.scorer = default_scorer(group_size)
    return ns.scorer


def compute_scores(ns: argparse.Namespace):
    """(HeadScores, LoadedModel | None, info) for the score / mask commands."""
    from analysis.score.scoring import weight_only_scorers

    weight_only = weight_only_scorers()
    if getattr(ns, "checkpoint", None) and ns.scorer is not None and ns.scorer not in weight_only:
        raise InputError(f"--checkpoint streams weights only; the {ns.scorer!r} scorer needs the model. "
                         f"Use one of {', '.join(weight_only)}, or --model to load it.")
    scorer = scorer_from(ns) if ns.scorer is not None else None   # bad options fail before loading
    with progress_bar("loading", not ns.quiet) as report:
        target, loaded, info = load_source(ns, report)
    if scorer is None:
        resolve_scorer(ns, info["group_size"])
        scorer = scorer_from(ns)
    if scorer.needs_calibration or loaded is None:
        score_target = target
    else:
        from analysis.measure.profiles import profile_model

        score_target = profile_model(loaded.model, adapter=loaded.adapter, source=loaded.name)
    with progress_bar(f"scoring ({ns.scorer})", not ns.quiet) as report:
        scores = scorer.score(score_target, progress=report, team=team_of(ns))
    return scores, loaded, info


# ---------------------------------------------------------------------------------------------
# Built-in commands
# ---------------------------------------------------------------------------------------------


def _score_arguments(parser):
    add_source_arguments(parser)
    add_scorer_arguments(parser)
    add_output_arguments(parser)


def run_score(ns):
    scores, _, info = compute_scores(ns)
    rows = [dict(layer=layer, head=head, score=float(scores.scores[layer, head]))
            for layer in range(scores.scores.shape[0]) for head in range(scores.scores.shape[1])]
    return dict(model=info, **scores.as_dict()), rows


def _mask_arguments(parser):
    _score_arguments(parser)
    parser.add_argument("--sparsity", type=float, required=True, help="fraction of heads to prune, in [0, 1)")
    parser.add_argument("--policy", choices=POLICIES, default="global")
    parser.add_argument("--min-per-layer", dest="min_per_layer", type=int, default=1)
    parser.add_argument("--flops-seq-len", dest="flops_seq_len", type=int, default=512,
                        help="sequence length for the attention FLOP count")
    add_kv_policy_argument(parser)


def add_kv_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-policy", dest="kv_policy", choices=KV_POLICIES, default="auto",
                        help="how surgery handles GQA layers whose kept query heads are spread unevenly over KV "
                             "groups: auto (copy K/V only there), expand (copy K/V in every layer), strict (refuse)")


def plan_from(ns):
    """(MaskPlan, HeadScores, LoadedModel | None, info) for the mask / evaluate / export commands."""
    scores, loaded, info = compute_scores(ns)
    plan = plan_mask(scores, ns.sparsity, group_size=info["group_size"], policy=ns.policy, min_per_layer=ns.min_per_layer)
    return plan, scores, loaded, info


def warn(lines) -> None:
    """Print each warning on stderr (the JSON/CSV result stays clean on stdout)."""
    for line in lines:
        sys.stderr.write(f"warning: {line}\n")


def run_mask(ns):
    plan, scores, loaded, info = plan_from(ns)
    bias = loaded is not None and loaded.adapter.has_qkv_bias(loaded.model)  # unknown when streamed
    dtype_bytes = next(loaded.model.parameters()).element_size() if loaded is not None else 4
    summary = summarize_mask(plan, scores, head_dim=info["head_dim"], hidden=info["hidden"],
                             seq_len=ns.flops_seq_len, bias=bias, kv_policy=ns.kv_policy, dtype_bytes=dtype_bytes)
    stock = _stock(ns, loaded, plan)
    warn(summary.warnings)
    rank = np.empty(plan.order.size, dtype=int)  # [L*H]
    rank[plan.order] = np.arange(plan.order.size)
    H = plan.pruned.shape[1]
    rows = [dict(layer=flat // H, head=flat % H, score=float(scores.scores.flat[flat]), rank=int(rank[flat]),
                 pruned=bool(plan.pruned.flat[flat])) for flat in range(plan.order.size)]
    payload = dict(model=info, scorer=scores.name, params=scores.params, cost=scores.cost.as_dict(),
                   sparsity=ns.sparsity, policy=ns.policy, kv_policy=ns.kv_policy, summary=summary.as_dict(),
                   stock=stock, pruned=plan.pruned.astype(int), kv_pruned=plan.kv_pruned.astype(int))
    return payload, rows


def _stock(ns, loaded, plan) -> dict:
    """Whether a stock config describes the mask (analysis.compress.export.stock_check), as JSON."""
    from analysis.compress.export import stock_check

    if loaded is not None:
        config = loaded.model.config
    else:
        from analysis.arch.checkpoint import checkpoint_folder, load_config
        config = load_config(checkpoint_folder(ns.checkpoint))
    try:
        check = stock_check(config, plan.pruned, kv_policy=ns.kv_policy, sparsity=ns.sparsity)
    except HeadscopeError as err:            # e.g. a family with no surgery entry
        return dict(ok=False, message=str(err), nearest=[])
    return dict(ok=check.ok, message=check.message(),
                nearest=[dict(sparsity=s, policy=p, kv_policy=kv, heads=h, kv_heads=k)
                         for s, p, kv, (h, k) in check.nearest[:3]])


def _model_mask_arguments(parser):
    """Mask arguments for commands that need the model itself (no --checkpoint streaming)."""
    add_source_arguments(parser, streaming=False)
    add_scorer_arguments(parser)
    parser.add_argument("--sparsity", type=float, required=True, help="fraction of heads to prune, in [0, 1)")
    parser.add_argument("--policy", choices=POLICIES, default="global")
    parser.add_argument("--min-per-layer", dest="min_per_layer", type=int, default=1)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _evaluate_arguments(parser):
    _model_mask_arguments(parser)
    parser.add_argument("--text-file", dest="text_file", default=None,
                        help="UTF-8 text to evaluate on (default: the built-in evaluation split); only its "
                             "first 64 KiB + 64 bytes per --max-tokens token are read")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=512, help="tokens to evaluate")
    parser.add_argument("--format", choices=("json", "csv"), default="json")
    parser.add_argument("--out", default=None, help="write here instead of stdout")


def run_evaluate(ns):
    """The model's metric (perplexity, pseudo-perplexity or embedding fidelity), dense and masked."""
    from analysis.measure.evaluation import evaluate
    from analysis.core.text import read_text_file, text_file_cap

    text = None
    if ns.text_file is not None:   # read (capped) before the model loads: a bad path fails at once
        text = read_text_file(ns.text_file, text_file_cap(ns.max_tokens), what="--text-file")
    plan, scores, loaded, info = plan_from(ns)
    pruned = np.stack([np.zeros_like(plan.pruned), plan.pruned])  # [2, L, H]: dense, masked
    with progress_bar("evaluating", not ns.quiet) as report:
        result = evaluate(loaded, text, pruned=pruned, max_tokens=ns.max_tokens, progress=report, team=team_of(ns))
    dense, masked = (float(v) for v in result.values)
    payload = dict(model=info, scorer=scores.name, params=scores.params, sparsity=ns.sparsity, policy=ns.policy,
                   metric=result.metric, higher_is_better=result.higher_is_better, n_tokens=result.n_tokens,
                   dense=dense, masked=masked, n_pruned=plan.n_pruned)
    return payload, [dict(metric=result.metric, dense=dense, masked=masked, n_pruned=plan.n_pruned)]


def _export_arguments(parser):
    from analysis.compress.export import FORMATS

    _model_mask_arguments(parser)
    parser.add_argument("--export-format", dest="export_format", choices=FORMATS, default="pruned",
                        help="zeroed (original shapes), pruned (+ head_layout.json), stock (uniform policy; "
                             "plain from_pretrained loads it) or onnx")
    parser.add_argument("--out-dir", dest="out_dir", required=True, help="output root folder")
    parser.add_argument("--name", required=True, help="folder to create under --out-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    add_kv_policy_argument(parser)


def run_export(ns):
    """Write the pruned model (atomically) and print what was written."""
    from analysis.compress.export import check_export_name, export, mask_record, resolve_under

    resolve_under(ns.out_dir, ns.name)   # a bad name fails before the model loads
    check_export_name(ns.name)
    plan, scores, loaded, info = plan_from(ns)
    record = mask_record(plan.pruned, geometry=loaded.geometry, model=loaded.name,
                         model_type=loaded.adapter.model_type, scores=scores, sparsity=ns.sparsity,
                         policy=ns.policy)
    surgery = {} if ns.export_format == "zeroed" else {"kv_policy": ns.kv_policy}   # zeroed keeps the shapes
    if surgery:
        g = loaded.geometry
        bias = loaded.adapter.has_qkv_bias(loaded.model)
        warn(summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, bias=bias,
                            kv_policy=ns.kv_policy).warnings)
    with progress_bar(f"exporting ({ns.export_format})", not ns.quiet) as report:
        result = export(ns.export_format, loaded.model, plan.pruned, ns.out_dir, ns.name, record=record,
                        tokenizer=loaded.tokenizer, overwrite=ns.overwrite, progress=report, **surgery)
    payload = dict(model=info, format=result.format, path=str(result.path), files=result.files,
                   total_bytes=result.total_bytes, n_pruned=plan.n_pruned)
    for note in result.notes:
        sys.stderr.write(f"note: {note}\n")
    sys.stderr.write(f"wrote {result.path} ({result.total_bytes / 2**20:.1f} MiB)\n")
    return payload, None


def _sweep_arguments(parser):
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--scorer", choices=("mp", "mp-g"), default=None,
                        help="default: mp-g on GQA/MQA models, mp on MHA models")
    parser.add_argument("--scope", choices=SCOPES, default="layer")
    parser.add_argument("--ord", type=int, choices=ORDS, default=2)
    parser.add_argument("--std", choices=tuple(STD_DDOF), default=DEFAULT_STD, help=_STD_HELP)
    parser.add_argument("--a-q", dest="a_q", type=float, default=1.0)
    parser.add_argument("--a-kv", dest="a_kv", type=float, default=1.0)
    parser.add_argument("--sparsity", type=float, required=True)
    parser.add_argument("--z-values", dest="z_values", default=None,
                        help="comma-separated z values (default 0.5, 0.75, ..., 3.0)")
    parser.add_argument("--policy", choices=POLICIES, default="global")
    parser.add_argument("--min-per-layer", dest="min_per_layer", type=int, default=1)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=512,
                        help="tokens of each split to evaluate")
    parser.add_argument("--evaluate-all", dest="evaluate_all", action="store_true",
                        help="evaluation split for every z, not only the suggested one")
    add_output_arguments(parser)


def parse_floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--z-values must be comma-separated numbers, e.g. 1.5,2,2.5; got {text!r}.") from None


def run_sweep(ns):
    from analysis.measure.profiles import profile_model
    from analysis.score.sweep import split_evaluators, sweep_z

    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    resolve_scorer(ns, loaded.geometry.group_size)
    profile = profile_model(loaded.model, adapter=loaded.adapter, source=loaded.name)
    calibration, evaluation, metric, higher = split_evaluators(loaded, max_tokens=ns.max_tokens, team=team_of(ns))
    zs = parse_floats(ns.z_values) if ns.z_values else None
    with progress_bar("z sweep", not ns.quiet) as report:
        result = sweep_z(profile, ns.sparsity, calibration, evaluation, zs=zs, scorer=ns.scorer,
                         scope=ns.scope, ord=ns.ord, a_q=ns.a_q, a_kv=ns.a_kv, std=ns.std, policy=ns.policy,
                         min_per_layer=ns.min_per_layer, metric=metric, higher_is_better=higher,
                         evaluate_all=ns.evaluate_all, progress=report)
    return dict(model=info, scorer=ns.scorer, **result.as_dict()), result.rows()


def _ablate_arguments(parser):
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--text-file", dest="text_file", default=None,
                        help="UTF-8 text to ablate on (default: the built-in evaluation split); only its first "
                             "64 KiB + 64 bytes per --max-tokens token are read")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=256, help="tokens of text to use")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=256,
                        help="causal LMs: the tokens are cut into sequences of at most this length")
    parser.add_argument("--method", choices=("fast", "naive"), default="fast",
                        help="fast (prefix reuse, batched gates) or naive (one full forward per head); same numbers")
    parser.add_argument("--no-groups", dest="groups", action="store_false",
                        help="skip the KV-group ablations of GQA models")
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=16, help="sequences per forward pass")
    add_output_arguments(parser)


def run_ablate(ns):
    """The metric change when each head alone (and each KV group) is removed."""
    from analysis.measure.ablation import head_ablation
    from analysis.core.text import read_text_file, text_file_cap

    for option in ("max_tokens", "seq_len", "batch_size"):
        if getattr(ns, option) < (2 if option != "batch_size" else 1):
            raise InputError(f"--{option.replace('_', '-')} must be at least {2 if option != 'batch_size' else 1}; "
                             f"got {getattr(ns, option)}.")
    text = None
    if ns.text_file is not None:
        text = read_text_file(ns.text_file, text_file_cap(ns.max_tokens), what="--text-file")
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    with progress_bar("ablation sweep", not ns.quiet) as report:
        result = head_ablation(loaded, text, max_tokens=ns.max_tokens, seq_len=ns.seq_len, method=ns.method,
                               groups=ns.groups, batch_size=ns.batch_size, progress=report, team=team_of(ns))
    G = loaded.geometry.group_size
    L, H = result.head_delta.shape
    rows = [dict(layer=l, head=h, kv_group=h // G, delta=float(result.head_delta[l, h]),
                 group_delta=None if result.group_delta is None else float(result.group_delta[l, h // G]))
            for l in range(L) for h in range(H)]
    payload = dict(model=info, metric=result.metric, method=result.method, base=result.base_loss,
                   n_tokens=result.n_tokens, processes=team_of(ns).world, head_delta=result.head_delta,
                   group_delta=result.group_delta, seconds={k: round(v, 4) for k, v in result.timings.items()})
    return payload, rows


register("score", "score every head with one scorer", _score_arguments, run_score, distributed=True)
register("mask", "the pruning mask at a sparsity, with its summary", _mask_arguments, run_mask, distributed=True)
register("sweep", "MP / MP-G metric vs z at a fixed sparsity", _sweep_arguments, run_sweep, distributed=True)
register("evaluate", "the model's metric dense and under the mask", _evaluate_arguments, run_evaluate,
         distributed=True)
register("ablate", "the metric change when each head alone (and each KV group) is removed", _ablate_arguments,
         run_ablate, distributed=True)
register("export", "write the pruned model (zeroed, pruned, stock or onnx) and mask.json", _export_arguments,
         run_export)


def _pipeline_arguments(parser):
    from analysis.compress.pipeline import cli_arguments
    cli_arguments(parser)


def run_pipeline_command(ns):
    from analysis.compress.pipeline import run_cli
    return run_cli(ns)


register("pipeline", "iterative prune -> distill -> INT8, with a compression report and the final exports",
         _pipeline_arguments, run_pipeline_command)

from analysis.cli import roles as _roles  # noqa: E402,F401  registers `roles` (what heads do)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m analysis",
                                     description="headscope: score, mask, sweep, evaluate and export attention heads headlessly.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.help))
    return parser


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt like Ctrl-C, so `finally` blocks remove temporaries; restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    out = getattr(ns, "out", None)
    command = COMMANDS[ns.command]
    team = distributed.SOLO
    try:
        with sigterm_as_interrupt():
            team = ns.team = distributed.team()          # SOLO unless a launcher started several processes
            if not team.is_main:
                if not command.distributed:
                    return 0                             # rank 0 runs this command alone
                if hasattr(ns, "quiet"):
                    ns.quiet = True                      # one set of progress bars: rank 0's
            if out is not None:
                check_output_file(out, "--out")          # before any work: say now what is wrong with it
            payload, rows = command.run(ns)
            text = render(payload, rows, getattr(ns, "format", "json"))
            if not team.is_main:
                pass                                     # rank 0 alone writes the result
            elif out is not None:
                atomic_write(out, text, what="--out")
            else:
                sys.stdout.write(text)
    except HeadscopeError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)   # one line, whatever the message holds
        return 2
    except KeyboardInterrupt:
        if team.is_distributed:
            print(f"error: the {team.world}-process run was stopped ({team.describe()}): another process ended "
                  f"(see the launcher's report) or the run was interrupted; nothing was written.", file=sys.stderr)
        else:
            print("error: interrupted (Ctrl-C or SIGTERM); temporary files were removed and nothing was "
                  "half-written. Run the command again to finish it.", file=sys.stderr)
        return 130
    finally:
        distributed.leave(team)
    return 0
