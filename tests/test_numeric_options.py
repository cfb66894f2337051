"""Numbers without bounds, issue 36 class 4 (and class 3's --seed): every numeric option is checked before
any work, with its allowed range in the one error line, in the CLI and in the library the app calls.

Before the fix: `roles --n-sequences 10000000` and `pipeline --recovery-tokens 10**18` ran for ever,
`export --export-format onnx --opset 5` wrote opset 18 with exit 0, `--opset -1` / `99999` were accepted,
`score --checkpoint --dtype int8` was accepted, `roles --seed 2**70` ended in an OverflowError traceback,
`pipeline --warmup -1` passed when no recovery ran, `pipeline --threads 10**9` ran every round before the
timings took the process down. Each case here must end within seconds (a deadline
turns a run that would go on for ever into a failure).
"""
from __future__ import annotations

import numpy as np
import pytest

from analysis.core.errors import InputError
from tests._input_checks import model_dir  # noqa: F401  (a fixture)
from tests._input_checks import cli_error, one_error_line, run_cli



ROLES = ["roles", "--quiet", "--detector", "induction"]
PIPELINE = ["pipeline", "--quiet", "--no-int8", "--formats", "pruned", "--eval-tokens", "16"]
EXPORT = ["export", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25"]
MASK = ["mask", "--quiet", "--scorer", "magnitude", "--sparsity", "0.25"]

# (id, argv after the command's base, regex of the flag and its range)
CASES = [
    ("roles-n-sequences", [*ROLES, "--n-sequences", 10**7], r"--n-sequences must be a whole number from 1 to 4,096"),
    ("roles-length", [*ROLES, "--length", 10**12], r"--length must be a whole number from 4 to 2,047"),
    ("roles-seed", [*ROLES, "--seed", 2**70], r"--seed must be a whole number from 0 to 9,223,372,036,854,775,807"),
    ("roles-seed-negative", [*ROLES, "--seed", -1], r"--seed must be a whole number from 0"),
    ("roles-permutations", [*ROLES, "--versus-mpg", "--permutations", 10**12], r"--permutations .* from 1 to 1,000,000"),
    ("roles-seq-len", [*ROLES, "--seq-len", 10**6], r"--seq-len must be a whole number from 2 to 4,096"),
    ("roles-max-tokens", [*ROLES, "--max-tokens", 10**12], r"--max-tokens must be a whole number from 2 to"),
    ("roles-z", [*ROLES, "--z", "nan"], r"\bz\b"),
    ("pipeline-recovery-tokens", [*PIPELINE, "--recovery-tokens", 10**18], r"Recovery tokens per round .* from 0 to"),
    ("pipeline-recovery-steps", [*PIPELINE, "--recovery-steps", 10**15], r"Recovery steps per round .* from 0 to 1,048,576"),
    ("pipeline-grad-accum", [*PIPELINE, "--recovery-steps", 1, "--grad-accum", 10**12], r"grad_accum .* from 1 to 65,536"),
    ("pipeline-warmup", [*PIPELINE, "--warmup", -1], r"warmup_steps .* from 0 to"),
    ("pipeline-eval-tokens", [*PIPELINE[:-2], "--eval-tokens", 10**12], r"Evaluation tokens must be a whole number"),
    ("pipeline-lora-rank", [*PIPELINE, "--lora", "--recovery-steps", 1, "--lora-rank", 10**9], r"lora_rank .* from 1 to 4,096"),
    ("pipeline-step-tokens", [*PIPELINE, "--recovery-steps", 1, "--train-batch", 2**16, "--train-seq-len", 2**16],
     r"batch_size x seq_len x grad_accum"),
    ("export-opset-5", [*EXPORT, "--export-format", "onnx", "--opset", 5], r"opset must be a whole number from 9 to 20"),
    ("export-opset-negative", [*EXPORT, "--export-format", "onnx", "--opset", -1], r"opset .* from 9 to 20"),
    ("export-opset-huge", [*EXPORT, "--export-format", "onnx", "--opset", 99999], r"opset .* from 9 to 20"),
    ("mask-flops-seq-len", [*MASK, "--flops-seq-len", 10**30], r"--flops-seq-len must be a whole number from 1 to"),
    ("mask-min-per-layer", [*MASK, "--min-per-layer", 10**12], r"--min-per-layer must be a whole number from 0 to 4,096"),
    ("sweep-min-per-layer", ["sweep", "--quiet", "--sparsity", "0.25", "--min-per-layer", -1],
     r"--min-per-layer must be a whole number from 0 to 4,096"),
]


@pytest.mark.parametrize("argv,problem", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_out_of_range_number_is_one_line_before_any_work(argv, problem, model_dir, tmp_path):
    command = argv[0]
    where = {"pipeline": ["--out-dir", tmp_path / "runs", "--name", "r"],
             "export": ["--out-dir", tmp_path / "exports", "--name", "e"]}.get(command, [])
    cli_error([*argv, "--model", model_dir, *where], problem, seconds=30)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "exports").exists()


def test_pipeline_threads_are_bounded_before_the_rounds(model_dir, tmp_path):
    """--threads is used by the last stage (the timings): it was accepted, the rounds ran, and 10**9 threads
    then took the process down. A subprocess, so that a broken build fails this test alone."""
    code, err, _ = run_cli([*PIPELINE, "--threads", 10**9, "--model", model_dir, "--out-dir", tmp_path / "runs",
                            "--name", "r"], timeout=120)
    assert code == 2, err[-2000:]
    one_error_line(err, r"--threads must be a whole number from 1 to 1,024")
    assert not (tmp_path / "runs").exists()


def test_score_checkpoint_refuses_a_bad_dtype(model_dir):
    cli_error(["score", "--quiet", "--checkpoint", model_dir, "--scorer", "magnitude", "--dtype", "int8"],
              r"Unknown dtype 'int8'", r"float32", seconds=30)


# -- the library the app and scripts call ---------------------------------------------------------------

def test_library_bounds():
    from analysis.compress.recover.distill import DistillConfig
    from analysis.compress.export import format_options
    from analysis.compress.recover.pipeline import PipelineConfig
    from analysis.core.errors import check_seed
    from analysis.core.threads import torch_threads
    from analysis.measure.detectors import InductionDetector
    from analysis.score.specialization import permutation_p

    refusals = {
        "recovery tokens": lambda: PipelineConfig(recovery_tokens=10**18).validate(),
        "recovery steps": lambda: PipelineConfig(recovery_steps=10**15).validate(),
        "steps": lambda: DistillConfig(steps=10**9).validate(),
        "warmup": lambda: PipelineConfig(distill=DistillConfig(warmup_steps=-1)).validate(),
        "opset": lambda: format_options("onnx", {"opset": 5}),
        "opset text": lambda: format_options("onnx", {"opset": "17"}),
        "sequences": lambda: InductionDetector(n_sequences=10**7),
        "length": lambda: InductionDetector(length=10**12),
        "detector seed": lambda: InductionDetector(seed=2**70),
        "permutations": lambda: permutation_p(np.arange(4.0), np.array([1, 0, 1, 0], bool), n_permutations=10**12),
        "seed": lambda: check_seed(2**70),
        "threads": lambda: torch_threads(10**9).__enter__(),
    }
    for what, call in refusals.items():
        with pytest.raises(InputError, match=r"from -?[\d,]+ to [\d,]+"):
            call()
    assert format_options("onnx", {"opset": 13})["opset"] == 13
