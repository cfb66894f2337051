"""What every command shares: the command registry (`register`, `COMMANDS`), progress bars on stderr,
JSON / CSV rendering, the source / placement / scorer / policy / output options and reading them back
(`load_source`, `compute_scores`, `plan_from`), and `warn`. Command modules import from here; nothing
under analysis/ outside the cli package imports it.

Light on purpose: building any command's options reads only declarations (the scorer, policy, probe,
detector and format registries), never torch or transformers; a command imports the library it runs
inside its `run`, so `--help`, `probes --list` and a refused option answer at once
(tests/test_cli_fast.py, bench/bench_cli.py).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from analysis.core import distributed
from analysis.core.errors import InputError, first_line
from analysis.core.params import Param
from analysis.score.masks import KV_POLICIES, POLICIES, check_sparsity, default_policy, plan_mask

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
    from tqdm import tqdm

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
    """JSON of the payload, or CSV of the rows (one column per key any row has; empty where a row lacks it)."""
    if fmt == "json":
        return json.dumps(to_jsonable(payload), indent=2) + "\n"
    if not rows:
        raise InputError("This command has no table to write as CSV; use --format json.")
    buffer = io.StringIO()
    columns = list(dict.fromkeys(key for row in rows for key in row))   # every row's keys (some rows have more)
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
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


def add_store_arguments(parser: argparse.ArgumentParser, *, rows: bool = False, precision: bool = True) -> None:
    """Options of the commands whose results are kept on disk (analysis.core.store): --refresh, --precision of the
    long-context passes, and --rows where the command can read the shared scan (kv-plan)."""
    from analysis.measure.long_options import PRECISION_CHOICES
    parser.add_argument("--refresh", action="store_true",
                        help="measure again even when the result is stored, and replace it (stored results are "
                             "listed and cleared by `cache list` / `cache clear`)")
    if precision:
        parser.add_argument("--precision", choices=PRECISION_CHOICES, default="float32",
                            help="precision of the long-context passes: bfloat16 where the CPU multiplies it natively "
                                 "(AVX-512 BF16 or AMX; refused elsewhere), several times faster, with its measured "
                                 "effect in docs/results.md (default float32)")
    if rows:
        parser.add_argument("--rows", choices=("own", "probes"), default="own",
                            help="own: each score on its own rows (plain text, needle items); probes: both from one "
                                 "shared pass over the long-context probes' rows, as the app's Long context page "
                                 "measures them (and stores them for it)")


def check_precision_option(ns: argparse.Namespace) -> None:
    """--precision bfloat16 on a device without native bfloat16 kernels: refused before the model loads (the
    device from the placement options, resolved as load_model will)."""
    if getattr(ns, "precision", "float32") == "float32":
        return
    from analysis.core.placement import Placement
    from analysis.measure.longpass import check_precision
    check_precision(ns.precision, Placement.of(**placement_kwargs(ns)).resolve().device)


def refused_line(lookup) -> None:
    """A stored result that could not be used (corrupt, another's): one warning line; it is measured again."""
    warn([f"the stored result {lookup.path} was not used ({lookup.why}); measuring it again"])


def stored_words(found: dict, quiet: bool = False) -> None:
    """One stderr line naming the parts read back from the store (and when they were measured)."""
    hits = [f"{part} (measured {f.about.get('stored', '?')} in {f.about.get('seconds', 0):.0f} s)"
            for part, f in found.items() if f.hit]
    if hits and not quiet:
        sys.stderr.write("read from the store: " + "; ".join(hits) + "\n")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=("json", "csv"), default="json")
    parser.add_argument("--out", default=None, help="write here instead of stdout")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def scorer_options() -> dict[str, Param]:
    """{parameter: declaration} over every registered scorer (analysis.score.scorer_registry.scorer_declarations:
    nothing imported): the CLI's scorer options. Parameters with a None default (array inputs such as the
    oracle's loss_increase) have no option."""
    from analysis.score.scorer_registry import SCORERS, scorer_declarations

    out = {}
    for name in SCORERS:
        for param, declared in scorer_declarations(name).items():
            if declared.default is not None:
                out.setdefault(param, declared)
    return out


def add_param_option(parser: argparse.ArgumentParser, name: str, param: Param, default=None) -> None:
    """`--name-with-dashes` for a declared parameter: typed from its default, its choices, its help.
    default=None: "the owner's default" (the value is only passed on when given)."""
    parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=param.type, choices=param.choices,
                        default=default, help=param.help or None)


def add_scorer_arguments(parser: argparse.ArgumentParser, choices=None, default: str | None = None) -> None:
    from analysis.score.scorer_registry import SCORERS

    parser.add_argument("--scorer", choices=choices or tuple(SCORERS), default=default,
                        help="default: mp-g on GQA/MQA models, mp on MHA models (equal there)")
    for name, param in scorer_options().items():
        add_param_option(parser, name, param)
    parser.add_argument("--ablation-file", default=None,
                        help="JSON or .npy [layers, heads] loss increases for --scorer ablation")


def scorer_from(ns: argparse.Namespace):
    """Build the chosen scorer from the options its constructor accepts."""
    from analysis.score.scorer_registry import get_scorer, scorer_parameters

    kwargs = {param: getattr(ns, param) for param in scorer_parameters(ns.scorer)
              if getattr(ns, param, None) is not None}
    if ns.scorer == "ablation" and getattr(ns, "ablation_file", None):
        kwargs["loss_increase"] = read_array(ns.ablation_file)
    return get_scorer(ns.scorer, **kwargs)


ARRAY_FILE_MAX_BYTES = 64 * 2**20   # a [L, H] table of numbers is far smaller


def read_array(path: str) -> np.ndarray:
    """A finite [L, H] float array from a .npy or JSON file (a list of lists, or {"head_delta": ...}),
    read through the one capped, regular-file-only reader (`analysis.core.files`)."""
    from analysis.core.files import read_file_bytes
    fix = ("Give a .npy file or a JSON list of lists of numbers, one row per layer "
           "(e.g. the head_delta of an ablation run).")
    raw = read_file_bytes(path, ARRAY_FILE_MAX_BYTES, what="--ablation-file", fix="give a .npy file or a JSON list of lists")
    try:
        if path.endswith(".npy"):
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        else:
            data = json.loads(raw.decode("utf-8"))
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


def check_counts(ns: argparse.Namespace, bounds: dict[str, tuple[int, int]]) -> None:
    """Each whole-number option `--dest-name` of `bounds` (dest -> (lowest, highest)) in its range, before any
    work: `check_whole_number`'s one-line InputError names the flag and the range. None (not given) passes."""
    from analysis.core.errors import check_whole_number
    for dest, (low, high) in bounds.items():
        check_whole_number(getattr(ns, dest), f"--{dest.replace('_', '-')}", low=low, high=high, none_ok=True)


def load_source(ns: argparse.Namespace, report, *, deferred: bool = False):
    """(target for scoring, LoadedModel or None, geometry-ish info dict) for --model / --checkpoint.

    deferred: the weights are not read (analysis.arch.models.load_deferred) unless the placement options ask for
    accelerate; a command that finds its results stored needs no more, `analysis.arch.models.materialize` loads
    them on a miss."""
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
        ords = (2, 1) if getattr(ns, "ord", 2) == 1 else (2,)  # the norms the scorer reads, from one read
        profile = profile_checkpoint(ns.checkpoint, progress=report, trust_remote_code=trust, ords=ords)
        return profile, None, dict(source=ns.checkpoint, **geometry.as_dict())
    from analysis.arch.models import DEFAULT_MODEL, load_deferred, load_model

    placement = placement_kwargs(ns)
    if deferred and all(placement[k] is None for k in ("device_map", "max_memory", "offload_folder")):
        loaded = load_deferred(ns.model or DEFAULT_MODEL, trust_remote_code=ns.trust_remote_code,
                               cache_dir=ns.cache_dir, progress=report, device=placement["device"],
                               dtype=placement["dtype"])
    else:
        loaded = load_model(ns.model or DEFAULT_MODEL, trust_remote_code=ns.trust_remote_code,
                            cache_dir=ns.cache_dir, progress=report, **placement)
    return loaded, loaded, dict(source=loaded.name, kind=loaded.kind, placement=loaded.placement.describe(),
                                **loaded.geometry.as_dict())


def resolve_scorer(ns: argparse.Namespace, group_size: int) -> str:
    """--scorer, or the model's default (analysis.score.scoring.default_scorer) when it was not given."""
    from analysis.score.scorer_registry import default_scorer

    if ns.scorer is None:
        ns.scorer = default_scorer(group_size)
    return ns.scorer


def compute_scores(ns: argparse.Namespace):
    """(HeadScores, LoadedModel | None, info) for the score / mask commands."""
    from analysis.score.scorer_registry import weight_only_scorers

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


def add_kv_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-policy", dest="kv_policy", choices=KV_POLICIES, default="auto",
                        help="how surgery handles GQA layers whose kept query heads are spread unevenly over KV "
                             "groups: auto (copy K/V only there), expand (copy K/V in every layer), strict (refuse)")


def plan_from(ns):
    """(MaskPlan, HeadScores, LoadedModel | None, info) for the mask / evaluate / export commands."""
    check_sparsity(ns.sparsity)                  # a bad sparsity fails before the model loads (and before jsonschema)
    from analysis.core.schemas import MAX_HEADS
    check_counts(ns, {"min_per_layer": (0, MAX_HEADS)})
    scores, loaded, info = compute_scores(ns)
    ns.policy = resolve_policy(ns, info["group_size"])
    plan = plan_mask(scores, ns.sparsity, group_size=info["group_size"], policy=ns.policy, min_per_layer=ns.min_per_layer)
    return plan, scores, loaded, info


# ---------------------------------------------------------------------------------------------
# The cut a report compares with the dense model: one set of options, one check, one meaning
# ---------------------------------------------------------------------------------------------

CUT_FLAGS = {"sparsity": "--sparsity", "mask_file": "--mask-file", "kv_plan": "--kv-plan", "export_dir": "--export"}


def add_cut_arguments(parser: argparse.ArgumentParser, *, scorer: bool = True) -> None:
    """The cut options every report takes (analysis.arch.cut.Cut): --sparsity (scored here, with the scorer and
    policy options), --mask-file, --kv-plan, --export. At most one is given (`check_one_cut`)."""
    if scorer:
        add_scorer_arguments(parser)
    parser.add_argument("--sparsity", type=float, default=None, help="cut: the mask at this sparsity (scored here)")
    add_policy_arguments(parser)
    parser.add_argument("--mask-file", dest="mask_file", default=None,
                        help="cut: a mask.json, or an export folder holding one, applied to --model")
    parser.add_argument("--kv-plan", dest="kv_plan", default=None,
                        help="cut: a kv_plan.json (or a folder holding one): per KV head full / window / prune, run "
                             "on --model")
    parser.add_argument("--export", dest="export_dir", default=None,
                        help="cut: an export folder's own weights (pruned, zeroed or stock) against --model as dense, "
                             "under the folder's kv_plan.json when it has one")


def _flags_words() -> str:
    flags = list(CUT_FLAGS.values())
    return ", ".join(flags[:-1]) + " or " + flags[-1]


def check_one_cut(ns: argparse.Namespace, *, required: bool = False) -> str | None:
    """The dest of the one cut option given (None: none), before anything loads; InputError for two, or for
    none when `required`."""
    given = [dest for dest in CUT_FLAGS if getattr(ns, dest, None) is not None]
    if len(given) > 1:
        raise InputError(f"Give one cut ({_flags_words()}), not " + " and ".join(CUT_FLAGS[g] for g in given) + ".")
    if required and not given:
        raise InputError(f"Give the cut to compare with the dense model: {_flags_words()}.")
    return given[0] if given else None


def cut_from(ns: argparse.Namespace, *, required: bool = False, deferred: bool = False):
    """(Cut | None, LoadedModel, info) from the cut options: the model loaded (and scored for --sparsity), the
    cut read and checked against it. A file's own checks (a mask.json's or a kv_plan.json's schema) come
    before the model loads; an export folder's kv_plan.json is applied, or refused with the reason
    (analysis.compress.export.planned.cut_of_folder). deferred: the model's weights are not read (`load_source`)
    for a cut that needs none (a mask file, a KV plan, none); --sparsity and --export load them."""
    from analysis.arch.cut import Cut
    kind = check_one_cut(ns, required=required)
    if kind == "sparsity":
        plan, scores, loaded, info = plan_from(ns)
        return Cut.of_mask(plan.pruned, info=dict(sparsity=ns.sparsity, scorer=scores.name, params=scores.params,
                                                  policy=ns.policy)), loaded, info
    plan = None
    if kind == "kv_plan":                              # the file's own checks before the model loads
        from analysis.arch.kvplan import read_kv_plan
        plan = read_kv_plan(ns.kv_plan)
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report, deferred=deferred and kind != "export_dir")
    if kind == "mask_file":
        from analysis.compress.export import read_mask_json
        record = read_mask_json(ns.mask_file, geometry=loaded.geometry)
        return Cut.of_mask(record.pruned(), info=dict(mask_file=str(ns.mask_file))), loaded, info
    if kind == "kv_plan":
        return Cut.of_plan(plan.check_geometry(loaded.geometry), info=dict(kv_plan=str(ns.kv_plan))), loaded, info
    if kind == "export_dir":
        from analysis.compress.export.planned import cut_of_folder
        return cut_of_folder(ns.export_dir, loaded, trust_remote_code=ns.trust_remote_code), loaded, info
    return None, loaded, info


def warn(lines) -> None:
    """Print each warning on stderr (the JSON/CSV result stays clean on stdout)."""
    for line in lines:
        sys.stderr.write(f"warning: {line}\n")


def policy_help() -> str:
    """--policy's help: the default, then each registered policy's own line (analysis.score.masks.POLICIES)."""
    return ("how the ranking becomes a mask (default: groups on GQA models, which never grows the model; global "
            "on MHA models, the paper's setting). " + " ".join(f"{name}: {p.help}" for name, p in POLICIES.items()))


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """--sparsity's mask policy (default: analysis.score.masks.default_policy of the model) and --min-per-layer."""
    parser.add_argument("--policy", choices=POLICIES, default=None, help=policy_help().replace("%", "%%"))
    parser.add_argument("--min-per-layer", dest="min_per_layer", type=int, default=1,
                        help="with --policy min-per-layer: the heads every layer keeps at least")


def resolve_policy(ns: argparse.Namespace, group_size: int) -> str:
    """The --policy given, else the model's default (groups on GQA, global on MHA)."""
    return ns.policy if ns.policy is not None else default_policy(group_size)


def add_model_mask_arguments(parser, streaming: bool = False, mask_file: bool = False):
    """Mask arguments for commands that need the model itself (streaming=True: --checkpoint too;
    mask_file=True: --mask-file, a mask.json instead of scores, and --sparsity becomes optional)."""
    add_source_arguments(parser, streaming=streaming)
    add_scorer_arguments(parser)
    parser.add_argument("--sparsity", type=float, required=not mask_file, default=None,
                        help="fraction of heads to prune, in [0, 1)")
    if mask_file:
        parser.add_argument("--mask-file", dest="mask_file", default=None,
                            help="a mask.json (of an export, or the app's download) to cut instead of scoring")
    add_policy_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
