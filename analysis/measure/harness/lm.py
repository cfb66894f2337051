"""The model behind the harness: any causal LM in memory behind the harness's `HFLM` (it takes a model object;
with transformers 5.23 it works as it is), subclassed only to report progress and check Stop at every
forward batch: batching, tokenization and log-likelihoods are the harness's. Generative tasks
(`generate_until`) run greedily, `generation_batch` prompts at a time (left padded, longest first, one row at a
time for a cut whose windows need rows from token 0: analysis.measure.harness.runs), the harness's prompts, its
stop rules and its scoring, headscope's decode loop (analysis.measure.harness.generation), each row's KV bytes
and speed recorded (in a batch: its share of the batch's).

The dense model is never changed: the harness gets a copy of the tokenizer (it may add a pad token) and its
`tie_weights` call is skipped for the construction (it could re-tie an untied head). A perplexity batch
whose logits would not fit in the free memory is refused before the run starts.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math

from analysis.core.errors import InputError
from analysis.core.progress import Progress, ShouldStop, check_stop, report
from analysis.measure.harness.generation import eos_ids, generation_rules, prompt_ids
from analysis.measure.harness.tasks import PreparedTasks

LOGITS_COPIES = 2               # a forward batch holds its logits and their log-softmax at once
MEMORY_SHARE = 0.8              # of the free memory, what a perplexity batch's logits (a generation batch) may take
TRANSIENT_WIDTHS = 16           # a prefill's activations per token, in hidden widths (residual, norms, MLP, ...)


@functools.lru_cache(maxsize=1)
def _lm_class():
    """HFLM with progress and Stop at each forward batch (defined on first use: lm_eval loads lazily)."""
    from lm_eval import utils as lm_utils
    from lm_eval.models.huggingface import HFLM

    class HeadscopeLM(HFLM):
        """The harness's HF model class over a model in memory. Additions: `track` sets a progress callback, a
        stop check and where a generation's KV cache comes from; each request call (log-likelihoods, rolling
        log-likelihoods, generations) is a phase whose rows (forward sequences, generated rows) are counted;
        `generate_until` is headscope's (greedy, `generation_batch` prompts at a time, costs recorded in
        `generations`)."""

        def track(self, progress: Progress | None, should_stop: ShouldStop | None, phases: int,
                  new_cache=None, generation_batch: int = 1) -> None:
            """new_cache: () -> a KV cache for one batch of prompts and its steps (None: the model's own);
            generation_batch: prompts generated together (1: one at a time)."""
            self._progress, self._should_stop = progress, should_stop
            self._generation_batch = int(generation_batch)
            self._phases, self._phase, self._rows, self._done = max(phases, 1), -1, 1, 0
            self._what, self._pending = "", None
            self._new_cache = new_cache or (lambda: None)
            self.generations: dict[str, list] = {}

        def _begin(self, rows: int, what: str) -> None:
            self._phase, self._rows, self._done, self._what = self._phase + 1, max(int(rows), 1), 0, what
            self._tell()

        def _tell(self) -> None:
            fraction = (self._phase + min(self._done / self._rows, 1.0)) / self._phases
            done = int(min(self._done, self._rows))
            report(self._progress, fraction, f"{self._what}: {done} of {self._rows} sequences")

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self._pending = "multiple choice"
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            windows = sum(len(list(lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(r.args[0]), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1))) for r in requests)
            self._pending = None
            self._begin(windows, "perplexity windows")
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            if self._pending is not None:             # a log-likelihood phase: one row per context group
                grouped = self.backend == "causal" and self.logits_cache
                rows = len({tuple(c) + tuple(k[:-1]) for _, c, k in requests}) if grouped else len(requests)
                self._begin(rows, self._pending)
                self._pending = None
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)

        def _within_batch(self, first: int, rows: int) -> Progress:
            """Progress inside one batch of generated rows: `first` rows done before it, `rows` in it."""
            def at(fraction: float, message: str) -> None:
                self._done = first + fraction * rows
                self._tell()
            return at

        def _request_row(self, request, eos_text: str) -> dict:
            """One request as generate_until runs it: its prompt ids (the last `room` of them, HFLM's
            truncation), stop strings, token budget, and whether the prompt was cut."""
            context, gen_kwargs = request.args
            until, max_new = generation_rules(gen_kwargs, eos_text, self.max_gen_toks)
            room = self.max_length - max_new
            if room <= 0:
                raise InputError(f"Task {request.task_name!r} generates up to {max_new} tokens, as many as the "
                                 f"model reads ({self.max_length}): no room for its prompt.")
            ids = prompt_ids(self.tokenizer, context, add_bos_token=self.add_bos_token)
            return dict(ids=ids[-room:], until=until, max_new=max_new, truncated=len(ids) > room)

        def generate_until(self, requests, disable_tqdm: bool = False):
            """Each request's greedy generation (HFLM.generate_until's tokens, truncation, stop rules and text
            post-processing; headscope's decode loop, which records each row's KV bytes and speed in
            self.generations[task], in the requests' order). Rows run longest first (HFLM's order: a batch that
            does not fit fails first), `generation_batch` at a time in one left-padded batch
            (analysis.measure.decode_rows; fewer where `rows_that_fit` says the memory would not hold them), each
            batch with a fresh cache; the texts come back in the requests' order. A batch's rows record their
            share of its seconds and bytes (Generated.batch)."""
            from lm_eval.models.utils import postprocess_generated_text
            from lm_eval.models.utils_hf import stop_sequences_criteria

            from analysis.measure.harness.generation import generate_rows
            from analysis.measure.probes.longcontext import stop_between_layers
            self._begin(len(requests), "generation")
            eos_text = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
            stop_ids = eos_ids(self.model)
            rows = [self._request_row(r, eos_text) for r in requests]
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i]["ids"]))      # stable: ties keep their order
            longest = max((len(r["ids"]) + r["max_new"] for r in rows), default=1)
            size = rows_that_fit(self.model, self._generation_batch, longest)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
            texts, records, done = [None] * len(rows), [None] * len(rows), 0
            with stop_between_layers(self.model, self._should_stop, "The harness run"):
                for first in range(0, len(order), size):
                    batch = order[first:first + size]
                    runs = generate_rows(
                        self.model, [rows[i]["ids"] for i in batch], max_new_tokens=[rows[i]["max_new"] for i in batch],
                        eos=stop_ids, stops=[stop_sequences_criteria(self.tokenizer, rows[i]["until"],
                                                                     len(rows[i]["ids"]), 1) for i in batch],
                        cache=self._new_cache(), pad_id=pad, progress=self._within_batch(done, len(batch)),
                        should_stop=self._should_stop)
                    for i, run in zip(batch, runs):
                        texts[i] = postprocess_generated_text(self.tok_decode(run.tokens), rows[i]["until"], None)
                        records[i] = dict(doc_id=int(requests[i].doc_id), truncated=rows[i]["truncated"],
                                          max_new_tokens=rows[i]["max_new"], **run.row())
                    done += len(batch)
                    self._done = done
                    self._tell()
            for request, record in zip(requests, records):
                self.generations.setdefault(request.task_name, []).append(record)
            return texts

        def _model_call(self, inps, attn_mask=None, labels=None):
            check_stop(self._should_stop, "The harness run")
            logits = super()._model_call(inps, attn_mask=attn_mask, labels=labels)   # [B, T, V]
            self._done += int(inps.shape[0])
            self._tell()
            return logits

    return HeadscopeLM


@contextlib.contextmanager
def _untied(model):
    """HFLM's constructor calls model.tie_weights(), which may re-tie what a loaded model keeps apart:
    skipped for the construction (an attribute on this instance, removed in finally)."""
    model.tie_weights = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del model.tie_weights


def make_lm(model, tokenizer, *, batch_size: int, max_length: int | None):
    with _untied(model):
        return _lm_class()(pretrained=model, tokenizer=copy.deepcopy(tokenizer), backend="causal",
                           batch_size=batch_size, max_length=max_length)


def _free_bytes(device) -> int:
    """Free memory where `device`'s tensors live: the GPU's, or the machine's available RAM."""
    import psutil
    import torch
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available


def row_bytes(model, tokens: int) -> int:
    """An estimate of one generated row's memory at `tokens` tokens: its KV cache (2 x L x Hkv x d values a
    token), a prefill's activations (TRANSIENT_WIDTHS hidden widths a token) and, for an eager kernel, its
    float32 attention scores of one layer (H x tokens^2)."""
    import torch
    from analysis.arch.adapters import adapter_for
    from analysis.arch.attention import current_implementation
    g = adapter_for(model).geometry(model)
    itemsize = torch.finfo(next(model.parameters()).dtype).bits // 8
    per_token = (2 * g.n_layers * g.n_kv_heads * g.head_dim + TRANSIENT_WIDTHS * g.hidden) * itemsize
    scores = 4 * g.n_heads * tokens * tokens if current_implementation(model) == "eager" else 0
    return tokens * per_token + scores


def rows_that_fit(model, requested: int, tokens: int) -> int:
    """How many rows of `tokens` tokens a generation batch takes: `requested`, fewer where `row_bytes` of them
    would pass MEMORY_SHARE of the free memory (at least 1: one row is what a one-at-a-time run needs anyway; 1
    for a model whose head geometry headscope cannot read)."""
    from analysis.core.errors import UnsupportedModelError
    if requested <= 1:
        return 1
    try:
        one = max(row_bytes(model, tokens), 1)
    except UnsupportedModelError:
        return 1
    fit = int(MEMORY_SHARE * _free_bytes(next(model.parameters()).device) // one)
    return max(1, min(int(requested), fit))


def check_logit_memory(prepared: PreparedTasks, lm, model, batch_size: int) -> None:
    """A perplexity task runs windows of up to lm.max_length tokens, batch_size at a time, the longest first:
    refuse (one line) a batch whose logits alone would not fit in the free memory, before the run starts."""
    rolling = {n: t for n, t in prepared.tasks.items() if t.OUTPUT_TYPE == "loglikelihood_rolling"}
    if not rolling:
        return
    import torch
    longest = windows = 0
    for task in rolling.values():
        for i, doc in enumerate(task.eval_docs):
            if prepared.limit is not None and i >= prepared.limit:
                break
            n = len(lm.tok_encode(task.doc_to_target(doc)))               # the harness's own tokens
            longest = max(longest, min(n + 1, lm.max_length))
            windows += max(1, math.ceil(n / lm.max_length))
    rows = min(batch_size, max(windows, 1))
    vocab = int(model.get_output_embeddings().weight.shape[0])
    itemsize = torch.finfo(next(model.parameters()).dtype).bits // 8
    need = LOGITS_COPIES * rows * longest * vocab * itemsize
    free = _free_bytes(next(model.parameters()).device)
    if need > MEMORY_SHARE * free:
        one = need // rows
        raise InputError(f"The perplexity task(s) {', '.join(rolling)} run windows of up to {longest} tokens, {rows} "
                         f"at a time: their logits alone take about {need / 2**30:.1f} GiB, more than the "
                         f"{MEMORY_SHARE * free / 2**30:.1f} GiB free to use. Give a smaller batch size "
                         f"(--harness-batch-size; 1 takes {one / 2**30:.1f} GiB) or a shorter window (--max-length).")
