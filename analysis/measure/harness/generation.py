"""Greedy generation the way the harness's HFLM asks for it: a prompt's tokens (`prompt_encoding`,
`prompt_ids`), a request's stop strings and token budget (`generation_rules`), the model's EOS token ids
(`eos_ids`, as transformers' generate stops on them), and `generate_greedy`: headscope's decode loop
(analysis.measure.decode: a prefill, then one token a step with a KV cache) recording each row's real
KV-cache bytes after the prompt and at the end, and its decode speed (`Generated`); `generate_rows`: the same
for several prompts in one left-padded batch (analysis.measure.decode_rows), each row's costs its share of the
batch's (`Generated.batch` says how many rows shared it).
"""
from __future__ import annotations

from dataclasses import dataclass

from analysis.core.errors import check_whole_number
from analysis.core.progress import Progress, ShouldStop

def prompt_encoding(tokenizer, context: str, *, add_bos_token: bool | None = None, offsets: bool = False):
    """The harness's HFLM encoding of a generation prompt (its tok_batch_encode of one string, before any
    truncation): the tokenizer's own special tokens unless the text already starts with its BOS token, or as
    add_bos_token says (HFLM's option; None: the tokenizer's default). offsets: each token's character span too
    (a fast tokenizer's offset_mapping)."""
    from lm_eval.models.utils import has_bos_prefix
    if has_bos_prefix(context, getattr(tokenizer, "bos_token", None)):
        special = {"add_special_tokens": False}
    else:
        special = {} if add_bos_token is None else {"add_special_tokens": add_bos_token}
    return tokenizer(context, return_offsets_mapping=offsets, **special)


def prompt_ids(tokenizer, context: str, *, add_bos_token: bool | None = None) -> list[int]:
    """The token ids the harness's HFLM feeds for a generation prompt (`prompt_encoding`)."""
    return list(prompt_encoding(tokenizer, context, add_bos_token=add_bos_token)["input_ids"])


def generation_rules(gen_kwargs: dict, eos_text: str | None, default_max: int = 256) -> tuple[list[str], int]:
    """(stop strings, max new tokens) of a request's generation_kwargs, as HFLM.generate_until reads them:
    the task's `until` (a string or a list) with the EOS text added, and max_gen_toks (or an alias; HFLM's
    default 256 when none is given)."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    kwargs = normalize_gen_kwargs(gen_kwargs, default_max)
    return handle_stop_sequences(kwargs.pop("until", None), eos=eos_text), int(kwargs.pop("max_gen_toks"))


def eos_ids(model) -> tuple[int, ...]:
    """The token ids transformers' generate stops on: the model's generation config's eos_token_id."""
    eos = model.generation_config.eos_token_id
    return () if eos is None else tuple(int(e) for e in ([eos] if isinstance(eos, int) else eos))


@dataclass(frozen=True)
class Generated:
    """One greedy generation: the new tokens, why it stopped, and what it cost."""
    tokens: list                   # the generated ids (an EOS that stopped it included)
    stopped: str                   # "eos" | "until" (a stop sequence) | "length" (max_new_tokens)
    prompt_tokens: int
    prefill_s: float               # the prompt's forward pass (its last logits give the first token)
    decode_s: float                # forwards of every later token, summed (each read after the device finished)
    kv_bytes_prompt: int           # the KV cache's real K / V bytes after the prompt
    kv_bytes_end: int              # ... after the last step (the prompt and every new token but the last)
    batch: int = 1                 # rows generated together: seconds and bytes are this row's share of the batch's

    @property
    def decode_steps(self) -> int:
        return max(len(self.tokens) - 1, 0)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: tokens of the decode steps per second (None when the prefill's token was the only one)."""
        return self.decode_steps / self.decode_s if self.decode_steps and self.decode_s > 0 else None

    def row(self) -> dict:
        return dict(prompt_tokens=self.prompt_tokens, new_tokens=len(self.tokens), stopped=self.stopped,
                    prefill_s=self.prefill_s, decode_s=self.decode_s, tokens_per_s=self.tokens_per_s,
                    kv_bytes_prompt=self.kv_bytes_prompt, kv_bytes_end=self.kv_bytes_end, batch=self.batch)


def generate_greedy(model, ids, *, max_new_tokens: int, eos=(), stop=(), cache=None,
                    progress: Progress | None = None, should_stop: ShouldStop | None = None) -> Generated:
    """Greedy decoding of one prompt ids [1, T] as transformers' generate does it, through headscope's decode loop
    (analysis.measure.decode.greedy): a prefill, then one token a step with the KV cache `cache` (None: the model's
    own DynamicCache; a KV plan's compact cache for one prompt), stopping after max_new_tokens, on a token in
    `eos`, or when a stop rule (`stop`: callables of the whole sequence [1, T + k] and None, the harness's
    MultiTokenEOSCriteria) says so; the token that stopped it is kept, as generate keeps it. The seconds are the
    prompt's forward and the sum of the decode calls' forwards, each read after the device finished
    (analysis.core.clock)."""
    from analysis.arch.adapters import input_device
    from analysis.arch.kvcache import kv_cache_bytes
    from analysis.core.clock import Clock
    from analysis.measure.decode import Stop, greedy
    check_whole_number(max_new_tokens, "max_new_tokens", low=1)
    run = greedy(model, ids, max_new_tokens, cache=cache, kv_bytes=kv_cache_bytes,
                 stop=Stop(tuple(int(e) for e in eos), tuple(stop)), clock=Clock(input_device(model)),
                 keep_logits=False, progress=progress, should_stop=should_stop)
    return Generated(run.tokens[0].tolist(), run.stopped, int(ids.shape[1]), run.prefill_seconds[0],
                     sum(wall for wall, _ in run.step_seconds), run.kv_bytes[0], run.kv_bytes[-1])


def generate_rows(model, prompts, *, max_new_tokens, eos=(), stops=None, cache=None, pad_id: int = 0,
                  progress: Progress | None = None, should_stop: ShouldStop | None = None) -> list[Generated]:
    """`generate_greedy` for B prompts (lists of ids, any lengths) in one left-padded batch
    (analysis.measure.decode_rows.greedy_rows): max_new_tokens one number or one per row; stops[i] row i's stop
    rules (callables of its own sequence [1, n_i + k] and None; None: none); `eos` ends any row; `cache` one for
    the whole batch (None: the model's own; a compact cache only without windowed heads). Each row's seconds
    and KV bytes are its share of the batch's (decode_rows' docstring: the prefill's seconds / B, each decode
    call's seconds / the rows it fed; the cache's bytes by the row's own tokens), `batch` = B."""
    from analysis.arch.adapters import input_device
    from analysis.arch.kvcache import kv_cache_bytes
    from analysis.core.clock import Clock
    from analysis.measure.decode import Stop
    from analysis.measure.decode_rows import greedy_rows
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    for budget in budgets:
        check_whole_number(budget, "max_new_tokens", low=1)
    eos = tuple(int(e) for e in eos)
    rules = [()] * len(prompts) if stops is None else [tuple(r or ()) for r in stops]
    run = greedy_rows(model, prompts, budgets, stops=[Stop(eos, r) for r in rules], cache=cache, pad_id=pad_id,
                      kv_bytes=kv_cache_bytes, clock=Clock(input_device(model)), keep_logits=False,
                      progress=progress, should_stop=should_stop)
    out = []
    for i, prompt in enumerate(prompts):
        prefill_s, decode_s = run.seconds(i)
        out.append(Generated(run.tokens[i], run.stopped[i], len(prompt), prefill_s, decode_s, *run.kv_bytes[i],
                             batch=len(prompts)))
    return out
