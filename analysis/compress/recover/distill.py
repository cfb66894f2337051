"""Recovery by knowledge distillation: the dense model teaches the pruned one.

`distill(teacher, student, data, config)` trains `student` (a pruned copy: physically
smaller from `surgery.prune_heads`, or full-shape under a head mask given as `gates`) to match
`teacher` (the dense model; only run forward, never changed) on token sequences cut from the
calibration text. A student that shares tensors with the teacher (a `prune_heads` twin shares
every untouched weight) first gets its own copies of them (`surgery.own_tensors`), so training
never writes into the teacher. The loss is a table keyed by the teacher's kind (`LOSSES`):
- "causal-lm" / "masked-lm": T^2 * KL(softmax(t/T) || softmax(s/T)) over the vocabulary at every
  position, + ce_weight * the next-token NLL (causal LMs only; analysis.measure.loss.next_token_nll),
  + hidden_weight * the mean MSE of the hidden states of every layer;
- "encoder" (no LM head): (1 - cosine) of the mean-pooled embedding + hidden_weight * hidden MSE.
Any other kind is refused (UnsupportedModelError).

Training: AdamW (fused where the device has the kernel), linear warmup then cosine decay,
gradient accumulation, gradient clipping, optional bfloat16 autocast (CPU and CUDA), a seed.
Precision (`PRECISIONS`, `resolve_precision`): "fp32"; "bf16" = torch.autocast(bfloat16): the
Linear / matmul work of the teacher and student forwards and of the backward runs in bfloat16,
while the master weights, their gradients and AdamW's state stay float32 (autocast casts a copy of
each weight per forward; the parameters are never bfloat16), and the loss (the log-softmax, KL and
cross-entropy of `kl_term` / `next_token_nll`, the hidden-state MSE) is computed in float32 on
float32 copies of the logits, and the student's attention core (SDPA) runs in float32
(analysis.arch.attention: its bfloat16 backward is the slower one on CPUs; the teacher, never
changed, keeps its own); "auto" = bf16 where the hardware has bfloat16 units (a CUDA device that
supports it, or a CPU whose /proc/cpuinfo flags list avx512_bf16 or amx_bf16), else fp32.
Budgets: `steps` sets the schedule; `max_seconds` stops training early once that much time has
passed, after at least one step (the cosine then has not reached 0; the result says how many steps
were done), and
`eval_every` > 0 calls `evaluate_fn(student)` (the held-out metric, under the gates) every that
many steps and at the end, into the step's history record as "heldout". Full fine-tuning, or LoRA adapters through
peft on every Linear layer but the output head (merged into the weights before `distill`
returns). The batch of each step is a pure function of (seed, step), so a run resumed from a
checkpoint sees the batches the uninterrupted run saw; a checkpoint (trainable weights,
optimizer, schedule, RNG, loss history) is written every `checkpoint_every` steps, atomically: a
temporary file next to it is renamed over it only once complete, so a disk that fills mid-write
leaves the previous checkpoint intact (CheckpointError says so). `resume=True` continues from it
and ends bit-identical (CPU, same seed) to an uninterrupted run.

Bad input: steps < 1, a text too short for one batch, mismatched vocabularies, an unknown kind,
a checkpoint from other settings -> InputError / UnsupportedModelError with what to do.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from analysis.core.atomic import disk_full, os_problem, remove_dead_temps, replaced_atomically
from analysis.core.errors import HeadscopeError, InputError, UnsupportedModelError, check_whole_number, first_line
from analysis.arch.attention import float32_attention
from analysis.arch.head_gates import head_mask
from analysis.measure.loss import next_token_nll
from analysis.arch.models import mean_pool
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.core.errors import check_seed, derived_seed
from analysis.score.scoring import as_subject
from analysis.compress.surgery import own_tensors
from analysis.core.text import MAX_TOKENS_LIMIT, calibration_text, tokenize

OnStep = Callable[[dict], None] | None

CHECKPOINT_FILE = "distill_checkpoint.pt"
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "auto": "auto"}
MAX_STEPS = 2**20                    # optimizer steps of one distillation (weeks of CPU time)
MAX_LORA_RANK = 4096                 # above any hidden size it would adapt
# whole-number settings -> (lowest, highest), checked by DistillConfig.validate (`check_whole_number`)
_WHOLE_SETTINGS = {"steps": (1, MAX_STEPS), "batch_size": (1, 2**16), "seq_len": (2, MAX_TOKENS_LIMIT),
                   "grad_accum": (1, 2**16), "lora_rank": (1, MAX_LORA_RANK), "max_sequences": (1, 2**20),
                   "warmup_steps": (0, MAX_STEPS), "checkpoint_every": (0, MAX_STEPS), "eval_every": (0, MAX_STEPS)}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")     # /proc/cpuinfo flags of CPUs with bfloat16 units


class CheckpointError(HeadscopeError):
    """A checkpoint could not be written (the previous one, if any, is intact)."""


@dataclass(frozen=True)
class DistillConfig:
    """Distillation settings. steps counts optimizer steps; each sees grad_accum batches of
    batch_size sequences of seq_len tokens."""
    steps: int = 80
    lr: float = 1e-4
    batch_size: int = 4
    seq_len: int = 128
    grad_accum: int = 1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    temperature: float = 2.0
    kl_weight: float = 1.0           # encoders: weight of the pooled-embedding term
    ce_weight: float = 0.0
    hidden_weight: float = 0.0
    lora: bool = False
    lora_rank: int = 8
    lora_alpha: float = 16.0
    precision: str = "fp32"          # "fp32" | "bf16" (autocast)
    seed: int = 0
    checkpoint_every: int = 0        # 0 = no checkpoints
    max_sequences: int = 256         # sequences cut from the text (the training set)
    dropout: bool = False            # train with the student's dropout on (off: it imitates the eval-mode teacher)
    max_seconds: float | None = None  # stop training after this long (None = run all steps)
    eval_every: int = 0              # held-out metric every N steps (0 = never; needs evaluate_fn)

    def validate(self) -> "DistillConfig":
        for name, (low, high) in _WHOLE_SETTINGS.items():
            check_whole_number(getattr(self, name), f"Distillation setting {name}", low=low, high=high)
        per_step = self.batch_size * self.seq_len * self.grad_accum
        if per_step > MAX_TOKENS_LIMIT:
            raise InputError(f"One distillation step of batch_size x seq_len x grad_accum = {per_step:,} tokens is "
                             f"more than the {MAX_TOKENS_LIMIT:,} any run trains on; lower them.")
        if self.max_seconds is not None and not (self.max_seconds > 0 and math.isfinite(self.max_seconds)):
            raise InputError(f"The time budget must be a positive number of seconds; got {self.max_seconds!r}.")
        if not (_finite_number(self.lr) and self.lr > 0):
            raise InputError(f"The learning rate must be a positive number; got {self.lr!r}.")
        if not _finite_number(self.temperature) or not self.temperature > 0:
            raise InputError(f"The temperature must be a finite number > 0 (e.g. 2); got {self.temperature!r}.")
        weights = {"kl_weight": self.kl_weight, "ce_weight": self.ce_weight, "hidden_weight": self.hidden_weight}
        for name, w in weights.items():                 # inf (or nan) would train a NaN model without a word
            if not _finite_number(w):
                raise InputError(f"Distillation setting {name} must be a finite number >= 0; got {w!r}.")
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise InputError("The loss weights (KL, cross-entropy, hidden states) must be >= 0 and not all 0.")
        check_seed(self.seed, "Distillation setting seed")
        if self.precision not in PRECISIONS:
            raise InputError(f"Unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}.")
        return self

    def fingerprint(self) -> str:
        """What a checkpoint must agree on to be resumed (everything but the step count)."""
        keys = {k: v for k, v in asdict(self).items()
                if k not in ("steps", "checkpoint_every", "max_seconds", "eval_every")}
        return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DistillResult:
    """The trained student (LoRA merged, eval mode) and the per-step history."""
    model: nn.Module
    history: list[dict] = field(default_factory=list)    # one {"step", "loss", "kl", "ce", "hidden", "lr"} per step
    steps_done: int = 0
    resumed_from: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    precision: str = "fp32"          # what ran ("auto" resolved)
    stopped_by_time: bool = False    # max_seconds ended it before `steps`


# ---------------------------------------------------------------------------------------------
# Data: sequences and the deterministic batch of each step
# ---------------------------------------------------------------------------------------------

def training_sequences(tokenizer, text: str | None, config: DistillConfig) -> torch.Tensor:
    """Token ids [n, seq_len] cut from `text` (None = the built-in calibration split).

    InputError when the text gives fewer than batch_size sequences (one batch)."""
    need = config.max_sequences * config.seq_len
    text = calibration_text(max_chars=need * 12) if text is None else text
    if tokenizer is None:
        raise InputError("Distilling from text needs the model's tokenizer; load it with load_model(...) or "
                         "pass token ids.")
    ids = tokenize(tokenizer, text, max_tokens=need)[0]                     # [N]
    n = ids.numel() // config.seq_len
    return check_sequences(ids[:n * config.seq_len].reshape(n, config.seq_len), config)  # [n, T]


def check_sequences(ids, config: DistillConfig) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 2 or ids.shape[1] < 2 or ids.is_floating_point():
        raise InputError(f"Training ids must be an integer tensor [sequences, tokens] with >= 2 tokens; got "
                         f"shape {list(ids.shape)}.")
    if ids.shape[0] < config.batch_size:
        raise InputError(f"The calibration text gives {ids.shape[0]} sequence(s) of {ids.shape[1]} tokens, fewer "
                         f"than one batch of {config.batch_size}. Give a longer text, or lower the batch size "
                         f"or the sequence length.")
    return ids.long()


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def batch_indices(n: int, batch_size: int, micro_step: int, seed: int) -> torch.Tensor:
    """Sequence indices [batch_size] of micro-step `micro_step`: consecutive slices of seeded
    per-epoch permutations of range(n), a pure function of its arguments."""
    out = []
    for position in range(micro_step * batch_size, (micro_step + 1) * batch_size):
        epoch, offset = divmod(position, n)
        g = torch.Generator().manual_seed(derived_seed(seed * 1_000_003, epoch))    # in torch's range for any seed
        out.append(int(torch.randperm(n, generator=g)[offset]))
    return torch.tensor(out, dtype=torch.long)                             # [batch_size]


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------------------------------------
# Losses, one per kind
# ---------------------------------------------------------------------------------------------

def kl_term(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(t/T) || softmax(s/T)), mean over positions. logits [B, T, V] -> scalar."""
    V = student_logits.shape[-1]
    s, t = student_logits.float().reshape(-1, V), teacher_logits.float().reshape(-1, V)  # [B*T, V]
    if temperature != 1:                   # x / 1.0 is x: two passes over B*T*V values saved
        s, t = s / temperature, t / temperature
    log_s = F.log_softmax(s, dim=-1)                                       # [B*T, V]
    log_t = F.log_softmax(t, dim=-1)                                       # [B*T, V]
    return temperature ** 2 * F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")


def hidden_term(student_hidden, teacher_hidden) -> torch.Tensor:
    """Mean over layers of the MSE of hidden states [B, T, D] (the embeddings' output included)."""
    pairs = list(zip(student_hidden, teacher_hidden))
    return sum(F.mse_loss(s.float(), t.float()) for s, t in pairs) / len(pairs)


def _lm_loss(student_out, teacher_out, ids, config: DistillConfig, causal: bool) -> dict[str, torch.Tensor]:
    parts = {"kl": kl_term(student_out.logits, teacher_out.logits, config.temperature)}
    if config.ce_weight > 0:
        parts["ce"] = next_token_nll(student_out.logits, ids).mean()      # [B, T-1] -> mean
    if config.hidden_weight > 0:
        parts["hidden"] = hidden_term(student_out.hidden_states, teacher_out.hidden_states)
    return parts


def _encoder_loss(student_out, teacher_out, ids, config: DistillConfig) -> dict[str, torch.Tensor]:
    s = mean_pool(student_out.hidden_states[-1].float())                  # [B, D]
    t = mean_pool(teacher_out.hidden_states[-1].float())                  # [B, D]
    parts = {"kl": (1.0 - F.cosine_similarity(s, t, dim=-1)).mean()}
    if config.hidden_weight > 0:
        parts["hidden"] = hidden_term(student_out.hidden_states, teacher_out.hidden_states)
    return parts


# kind -> loss parts (weights applied by `weighted`); "kl" is the pooled-embedding term for encoders
LOSSES = {
    "causal-lm": lambda s, t, ids, c: _lm_loss(s, t, ids, c, causal=True),
    "masked-lm": lambda s, t, ids, c: _lm_loss(s, t, ids, c, causal=False),
    "encoder": _encoder_loss,
}
WEIGHTS = {"kl": "kl_weight", "ce": "ce_weight", "hidden": "hidden_weight"}


def weighted(parts: dict[str, torch.Tensor], config: DistillConfig) -> torch.Tensor:
    return sum(getattr(config, WEIGHTS[name]) * value for name, value in parts.items())


def check_kind(kind: str, config: DistillConfig) -> None:
    if kind not in LOSSES:
        raise UnsupportedModelError(f"A {kind!r} model cannot be distilled: headscope distills causal LMs, "
                                    f"masked LMs and encoders ({', '.join(LOSSES)}).")
    if config.ce_weight > 0 and kind != "causal-lm":
        raise InputError(f"The cross-entropy term needs next-token labels, which a {kind} model has not; "
                         f"set its weight to 0.")


def _forward(model, ids: torch.Tensor, want_hidden: bool):
    """One forward pass on ids [B, T] without a KV cache (where the config has one). The batches
    have no padding, so no attention mask is passed (the model's default: attend to all)."""
    extra = {"use_cache": False} if getattr(model.config, "use_cache", None) is not None else {}
    return model(input_ids=ids, output_hidden_states=want_hidden, **extra)


@torch.no_grad()
def mean_kl(teacher, student, ids, *, temperature: float = 1.0, gates=None, batch_size: int = 8) -> float:
    """KL(teacher || student) per position at `temperature` (no T^2 factor) on ids [n, T]."""
    t_model = as_subject(teacher).model
    total, count = 0.0, 0
    mask = contextlib.nullcontext() if gates is None else head_mask(student, gates)
    with mask:
        for chunk in torch.split(torch.as_tensor(ids).long(), batch_size):
            s, t = _forward(student, chunk, False).logits, _forward(t_model, chunk, False).logits  # [b, T, V]
            total += float(kl_term(s, t, temperature)) / temperature ** 2 * chunk.shape[0] * chunk.shape[1]
            count += chunk.shape[0] * chunk.shape[1]
    return total / count


# ---------------------------------------------------------------------------------------------
# Checkpoints (atomic)
# ---------------------------------------------------------------------------------------------

def _trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save `state` to `path` atomically (`atomic.replaced_atomically`): any failure leaves
    `path` with its old content and no temporary file behind; temporaries of a run killed earlier
    (SIGKILL) are removed first (`atomic.remove_dead_temps`)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_temps(path.parent, path.name)
        with replaced_atomically(path) as handle:
            torch.save(state, handle)
    except (OSError, RuntimeError) as err:
        # torch reports a failed write as RuntimeError ("[enforce fail at inline_container.cc]"),
        # sometimes without the OS error; a RuntimeError that is no write failure passes through
        if isinstance(err, RuntimeError) and not (disk_full(err) or "inline_container" in str(err)):
            raise
        if isinstance(err, OSError):
            problem, fix = os_problem(err)
        elif disk_full(err):
            problem, fix = os_problem(OSError(errno.ENOSPC, ""))
        else:
            problem, fix = "the file could not be written (the disk may be full)", "free some space or write to another disk"
        previous = "the previous checkpoint is intact" if path.is_file() else "no earlier checkpoint exists"
        raise CheckpointError(f"The checkpoint at step {state.get('step')} could not be written to {path}: "
                              f"{problem}; {previous}. To go on, {fix} (or choose another checkpoint folder) "
                              f"and resume.") from None


def param_shapes(params: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """What a checkpoint records of the trainable tensors, so a resume can check the student fits."""
    return {name: list(p.shape) for name, p in params.items()}


def load_checkpoint(path: Path, config: DistillConfig) -> dict | None:
    """The checkpoint at `path` (None if there is none), loaded weights-only: tensors and plain
    data, never code (a crafted pickle is refused, its payload never runs)."""
    import pickle
    import warnings
    path = Path(path)
    remove_dead_temps(path.parent, path.name)
    if not path.is_file():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")              # torch's notes on old pickle protocols, before our line
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError, TypeError,
            AttributeError, KeyError, IndexError, ImportError, MemoryError) as err:
        reason = ("it holds objects other than tensors and plain data, which are never loaded (they can run code)"
                  if isinstance(err, pickle.UnpicklingError) else f"{type(err).__name__}: truncated or not a checkpoint")
        raise InputError(f"The checkpoint {path} cannot be read ({reason}); delete it to start over.") from None
    if not isinstance(state, dict) or state.get("fingerprint") != config.fingerprint():
        raise InputError(f"The checkpoint {path} was written with other distillation settings; use the same "
                         f"settings to resume, or delete it to start over.")
    return state


def _restore(state: dict, path: Path, params: dict, optimizer, schedule, config: DistillConfig) -> tuple[list, int]:
    """Put a checkpoint's tensors, optimizer, schedule and RNG back; (history, step to go on from). A checkpoint
    whose fingerprint matches but whose contents are damaged or edited (a missing key, a step that is no
    whole number in 0 .. MAX_STEPS, tensors of another shape) is one InputError, never a KeyError from deep
    inside."""
    try:
        step, history, saved = state["step"], state["history"], state["params"]
        if (isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEPS
                or not isinstance(history, list) or not isinstance(saved, dict) or set(saved) != set(params)):
            raise ValueError("its step, history or tensors are not what a checkpoint of these settings holds")
        with torch.no_grad():
            for name, value in saved.items():
                if not isinstance(value, torch.Tensor) or value.shape != params[name].shape:
                    raise ValueError(f"tensor {name} does not fit the student")
                params[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
        raise InputError(f"The checkpoint {path} is damaged or was edited ({first_line(err, 120)}); delete it to "
                         f"start over.") from None
    return list(history), step


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

def add_lora(model: nn.Module, config: DistillConfig) -> nn.Module:
    """peft LoRA adapters on every Linear layer but the output head (the model is changed in place)."""
    from peft import LoraConfig, get_peft_model
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                      target_modules="all-linear", init_lora_weights=True)
    torch.manual_seed(config.seed)
    return get_peft_model(model, lora)


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain model with the LoRA updates B @ A * alpha / r added into its weights."""
    return model.merge_and_unload().eval()


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU reports bfloat16 units (a flag of BF16_CPU_FLAGS in /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return any(flag in flags for flag in BF16_CPU_FLAGS)


BF16_UNITS = {
    "cpu": lambda device: cpu_has_bf16(),
    "cuda": lambda device: torch.cuda.is_bf16_supported(),
}


def resolve_precision(precision: str, device) -> str:
    """"auto" -> "bf16" where `device` has bfloat16 units (BF16_UNITS), else "fp32"; others as given."""
    if precision != "auto":
        return precision
    has = BF16_UNITS.get(torch.device(device).type, lambda device: False)
    return "bf16" if has(device) else "fp32"


FUSED_ADAMW = ("cpu", "cuda")     # devices with torch's fused AdamW kernel (one pass over every tensor)


def make_optimizer(params: list[nn.Parameter], config: DistillConfig, device: torch.device):
    """AdamW over `params`, fused where the device has the kernel: the per-tensor loop of the default
    CPU implementation took 0.46 of a 2.5 s bf16 step on SmolLM2-135M (2 threads), the fused one 0.09."""
    fused = device.type in FUSED_ADAMW and all(p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True if fused else None)


def _autocast(config: DistillConfig, device: torch.device):
    dtype = PRECISIONS[resolve_precision(config.precision, device)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def _prepared(teacher, student: nn.Module, data, config: DistillConfig, checkpoint_dir, resume: bool):
    """(the teacher as a Subject, the training ids [n, T], the checkpoint path or None), every input
    checked before anything trains; the student gets its own copies of the tensors it shares."""
    subject = as_subject(teacher)
    check_kind(subject.kind, config)
    if student is subject.model:
        raise InputError("The student must be a pruned copy of the teacher, not the teacher itself (the dense "
                         "model is never trained).")
    own_tensors(student, subject.model)     # a weight-sharing prune_heads twin gets its own copies first
    ids = (check_sequences(data, config) if isinstance(data, torch.Tensor)
           else training_sequences(subject.tokenizer, data, config))       # [n, T]
    t_vocab = subject.model.config.get_text_config().vocab_size
    s_vocab = student.config.get_text_config().vocab_size
    if t_vocab != s_vocab:
        raise InputError(f"Teacher and student have different vocabularies ({t_vocab} vs {s_vocab}); "
                         f"distill a pruned copy of the teacher.")
    if int(ids.max()) >= t_vocab:
        raise InputError(f"Token id {int(ids.max())} is outside the model's vocabulary of {t_vocab}.")
    path = None if checkpoint_dir is None else Path(checkpoint_dir) / CHECKPOINT_FILE
    if (resume or config.checkpoint_every) and path is None:
        raise InputError("Checkpoints and resuming need a checkpoint folder.")
    return subject, ids, path


class _Run:
    """One distillation run's trainable state: the student (with LoRA adapters when asked), its
    optimizer and schedule, the history, the step it starts from (a resumed checkpoint's)."""

    def __init__(self, student: nn.Module, config: DistillConfig, path: Path | None, resume: bool):
        self.config, self.base = config, student
        self.trained = add_lora(student, config) if config.lora else student
        if not config.lora:
            for p in self.trained.parameters():
                p.requires_grad_(True)
        self.params = _trainable(self.trained)
        self.device = next(self.trained.parameters()).device
        self.optimizer = make_optimizer(list(self.params.values()), config, self.device)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))
        self.history: list[dict] = []
        self.start = 0
        state = load_checkpoint(path, config) if resume else None
        if state is not None and state.get("shapes") != param_shapes(self.params):
            raise InputError(f"The checkpoint {path} was written for a student of another shape (its trainable "
                             f"tensors differ); resume with the same student, or delete it to start over.")
        if state is not None:
            self.history, self.start = _restore(state, path, self.params, self.optimizer, self.schedule, config)
        else:
            torch.manual_seed(config.seed)

    def step(self, subject, ids: torch.Tensor, step: int, want_hidden: bool) -> dict:
        """One optimizer step over grad_accum batches of ids [n, T]; its record (losses averaged, lr)."""
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for a in range(config.grad_accum):
            rows = batch_indices(ids.shape[0], config.batch_size, step * config.grad_accum + a, config.seed)  # [B]
            x = ids[rows].to(self.device)                                       # [B, T]
            with torch.no_grad(), _autocast(config, self.device):
                t_out = _forward(subject.model, x, want_hidden)
            with _autocast(config, self.device):
                s_out = _forward(self.trained, x, want_hidden)
            parts = LOSSES[subject.kind](s_out, t_out, x, config)
            loss = weighted(parts, config) / config.grad_accum
            loss.backward()
            for name, value in {"loss": loss * config.grad_accum, **parts}.items():
                sums[name] = sums.get(name, 0.0) + float(value.detach()) / config.grad_accum
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), config.max_grad_norm)
        record = {"step": step + 1, **sums, "lr": self.optimizer.param_groups[0]["lr"]}
        self.optimizer.step()
        self.schedule.step()
        return record

    def held_out(self, evaluate_fn: Callable[[nn.Module], float]) -> float:
        """The held-out metric of the student in eval mode (the gates applied by the caller's block)."""
        self.trained.eval()
        try:
            return float(evaluate_fn(self.base))
        finally:
            self.trained.train(self.config.dropout)

    def checkpoint(self, step: int) -> dict:
        """What save_checkpoint writes after `step` steps (resume continues bit for bit from it)."""
        return {"step": step, "fingerprint": self.config.fingerprint(), "history": self.history,
                "shapes": param_shapes(self.params),
                "params": {n: p.detach().clone() for n, p in self.params.items()},
                "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict(),
                "rng": torch.get_rng_state()}


def distill(teacher, student: nn.Module, data=None, config: DistillConfig = DistillConfig(), *,
            gates=None, checkpoint_dir=None, resume: bool = False, merge: bool = True,
            progress: Progress | None = None, should_stop: ShouldStop | None = None, on_step: OnStep = None,
            evaluate_fn: Callable[[nn.Module], float] | None = None) -> DistillResult:
    """Train `student` (changed in place: a pruned copy; any tensor it shares with the teacher is
    copied first, `surgery.own_tensors`) to imitate `teacher`.

    teacher: LoadedModel (its kind and tokenizer are used) or nn.Module. data: token ids
    [n, T], text, or None (the built-in calibration split). gates: [L, H] head mask applied to
    the student during training (a full-shape student whose pruned heads are masked).
    checkpoint_dir: where `distill_checkpoint.pt` goes every `config.checkpoint_every` steps;
    resume=True continues from it (from step 0 when there is none yet). on_step(record) after every step (for live loss curves).
    evaluate_fn(student) -> the held-out metric, called every `config.eval_every` steps and after the
    last one (the student in eval mode, the gates applied); its value goes into the record as "heldout".
    Returns a DistillResult whose model is the trained student in eval mode, its LoRA adapters
    merged into the weights (merge=False: the peft model, for `merge_lora` later)."""
    config = config.validate()
    subject, ids, path = _prepared(teacher, student, data, config, checkpoint_dir, resume)
    run = _Run(student, config, path, resume)
    want_hidden = config.hidden_weight > 0 or subject.kind == "encoder"
    precision = resolve_precision(config.precision, run.device)
    mask = contextlib.nullcontext() if gates is None else head_mask(run.base, gates)
    attention = float32_attention(run.base) if precision == "bf16" else contextlib.nullcontext()
    subject.model.eval()
    run.trained.train(config.dropout)
    stopped_by_time, done = False, 0
    began = time.perf_counter()

    def out_of_time() -> bool:
        return config.max_seconds is not None and time.perf_counter() - began >= config.max_seconds

    try:
        with mask, attention:
            for step in range(run.start, config.steps):
                check_stop(should_stop, "Distillation")
                if step > run.start and out_of_time():                         # at least one step
                    stopped_by_time = True
                    break
                record = run.step(subject, ids, step, want_hidden)
                done += 1
                last = step + 1 == config.steps or out_of_time()
                if evaluate_fn is not None and config.eval_every and ((step + 1) % config.eval_every == 0 or last):
                    record["heldout"] = run.held_out(evaluate_fn)
                run.history.append(record)
                if on_step is not None:
                    on_step(record)
                report(progress, (step + 1) / config.steps,
                       f"distillation: step {step + 1}/{config.steps}, loss {record['loss']:.4f}")
                if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
                    save_checkpoint(path, run.checkpoint(step + 1))
    finally:
        run.trained.eval()
    seconds = time.perf_counter() - began
    model = merge_lora(run.trained) if config.lora and merge else run.trained
    model.requires_grad_(False)
    tokens = done * config.grad_accum * config.batch_size * ids.shape[1]
    return DistillResult(model=model.eval(), history=run.history, steps_done=run.start + done,
                         resumed_from=run.start, seconds=seconds,
                         tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                         precision=precision, stopped_by_time=stopped_by_time)


def with_steps(config: DistillConfig, steps: int) -> DistillConfig:
    """The same settings with another step count (what a pipeline round uses)."""
    return replace(config, steps=int(steps))
