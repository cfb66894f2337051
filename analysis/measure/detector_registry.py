"""The detector registry: one record per head detector (`DetectorSpec`: its name, the title of its map, a
help line, how to read its map, where it applies, whether it needs text, how to build it), registered
once with `register_detector`; the CLI's `roles --detector`, the app's Heads page and
`analysis.measure.detectors.detect_heads` read `DETECTORS`, so a new detector is one class and one record.

Declarations apart from implementations: this module imports neither torch nor transformers, so the
CLI's parser reads it for free. A record's `build` is a callable (tokenizer or None, options) ->
detector, or the reference of one, "package.module:Name" (`analysis.core.registry.load`), imported the
first time the detector is built: a builder function (or classmethod), or a detector class, which is
then built from the options its constructor names (and the tokenizer, when it takes `tokenizer`). The
built-in records at the bottom name their detectors this way (the classes: analysis.measure.detectors,
circuits, dla).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from analysis.core.registry import Registry, resolved, taken_keywords

Builder = Callable[[object, dict], object]      # (tokenizer or None, options) -> a detector (verb: detect)


@dataclass(frozen=True)
class DetectorSpec:
    """One detector, registered once (`register_detector`): what the CLI, the app and `detect_heads` read."""
    name: str                                          # the CLI's --detector choice, the key of the results
    title: str                                         # the title of its [L, H] map: what the score measures
    help: str                                          # one line: the CLI's help, the app's caption
    about: str                                         # how to read the map (the app's folded text)
    build: Builder | str                               # (tokenizer or None, options) -> a detector (verb: detect),
                                                       # or its reference "package.module:Name" (module docstring)
    needs_text: bool = False                           # reads the user's text (else builds its input or reads weights)
    decoder_only: bool = False                         # needs an unembedding: refuses encoders with one line
    signed: bool = False                               # an effect with a sign (DLA), not a role tag
    long: bool = False                                 # reads long contexts (minutes on a CPU): never in the
                                                       # default set; run when named, on a button in the app
    context: int = 0                                   # a long detector's default context (tokens) in the app

    @property
    def builder(self) -> Builder:
        """The callable that builds this detector (its module imported now when `build` is a reference)."""
        target = resolved(self.build)
        return class_builder(target) if isinstance(target, type) else target

    def applies_to(self, kind: str) -> bool:
        """Whether it runs on a model of `kind` ("causal-lm" | "masked-lm" | "encoder")."""
        return not self.decoder_only or kind == "causal-lm"


DETECTORS: Registry = Registry("detector")


def register_detector(spec: DetectorSpec) -> DetectorSpec:
    """Add a detector to the registry; InputError for a taken name (the same record again is a no-op)."""
    return DETECTORS.add(spec.name, spec)


def default_detectors(kind: str | None = None) -> list[str]:
    """The quick detectors (not `long`), in registration order; those that apply to `kind` if given: what
    `detect_heads`, `roles` and the Heads page run when no detector is named."""
    return [n for n, spec in DETECTORS.items() if not spec.long and (kind is None or spec.applies_to(kind))]


def detector_spec(name: str) -> DetectorSpec:
    """The registered detector; InputError naming the choices otherwise."""
    return DETECTORS.of(name)


def class_builder(cls: type) -> Builder:
    """A builder for a detector class: the options its constructor names (the others are for other
    detectors), and the tokenizer when the constructor takes `tokenizer`."""
    keys = taken_keywords(cls)

    def build(tokenizer, options: dict):
        given = {k: v for k, v in options.items() if k in keys and k != "tokenizer"}
        return cls(**given, **({"tokenizer": tokenizer} if "tokenizer" in keys else {}))
    return build


# The built-in detectors: one record each; `build` names the implementation, imported on first use (a
# new detector: its class in analysis/measure/detectors.py or its own module of measure/, and one record
# here; docs/ARCHITECTURE.md, "How to add a head detector").
_HERE = "analysis.measure.detectors"
for _spec in (
    DetectorSpec("previous-token", "Previous-token score (attention on token i-1)",
                 "mean attention on the previous token (text)",
                 about="""\
Mean attention that each query puts on the token just before it, over the text. 1 = the head
always looks one token back. This is the same statistic as the *previous-token* role tag above
(one definition). Previous-token heads feed induction heads: they write "the token before me was
X" into the residual stream.""",
                 build=f"{_HERE}:PreviousTokenDetector", needs_text=True),
    DetectorSpec("induction", "Induction score (attention to the token after the earlier copy)",
                 "attention to the token after the earlier copy (repeated random tokens)",
                 about="""\
The model reads sequences of random tokens repeated twice ([BOS] r r). For each token of the
second copy, an induction head attends to the token that came *after* the same token in the
first copy (Olsson et al. 2022), so it can predict the repeat. Score = mean attention on exactly
that key; 1 = perfect. The **in-context-learning score** is the whole model's loss on the first
copy minus the loss on the second: how much the repeat helps.""",
                 build=f"{_HERE}:InductionDetector.for_tokenizer"),
    DetectorSpec("duplicate-token", "Duplicate-token score (attention to earlier copies of the token)",
                 "attention to earlier occurrences of the same token (repeated random tokens)",
                 about="""\
On the same repeated random sequences: how much attention a token puts on earlier occurrences
of itself. Duplicate-token heads tell later heads "this token appeared before".""",
                 build=f"{_HERE}:DuplicateTokenDetector.for_tokenizer"),
    DetectorSpec("copying", "Copying score (OV circuit eigenvalue share)",
                 "OV circuit eigenvalue share: maps tokens to themselves (weights; decoders)",
                 about="""\
From weights only: the head's OV circuit maps an input token to output logits
(unembedding x final-norm scale x W_O x W_V x input-norm scale x embedding). A copying head
raises the logit of the token it attends to: the circuit's eigenvalues are mostly positive.
Score = sum of the eigenvalues' real parts / sum of their magnitudes (Elhage et al. 2021), from
-1 to 1. Computed exactly over the whole vocabulary through a d x d factor of the circuit.
Decoders only (it needs an unembedding).""",
                 build="analysis.measure.circuits:CopyingDetector", decoder_only=True),
    DetectorSpec("successor", "Successor score (OV circuit maps ordinals to the next one)",
                 "OV circuit maps ordinals to the next one: 1->2, Monday->Tuesday (weights; decoders)",
                 about="""\
From weights only: does the head's OV circuit send an ordinal token to the next one (1 -> 2,
Monday -> Tuesday, January -> February, A -> B)? Score = the share of ordinal tokens whose
highest circuit logit, among the tokens of the same list, is their successor (Gould et al. 2023;
chance is about one over the list's length). This reads the raw token embeddings; the paper reads
them after the first MLP, so a head can be a successor head there and score lower here.""",
                 build="analysis.measure.circuits:SuccessorDetector",
                 decoder_only=True),
    DetectorSpec("dla", "Direct logit attribution (mean logit added to the correct next token)",
                 "direct logit attribution to the correct next token (text; decoders)",
                 about="""\
Each head's output, pushed through the final norm (its scale frozen at the value it has on the
full residual) and the unembedding, dotted with the correct next token's direction: how many
logits the head adds to the right answer directly, averaged over the text. Red = helps, blue =
hurts. The heads plus the embeddings, the MLPs and the biases add up to the logit exactly.
Indirect effects (a head that helps through later layers) are not counted. Decoders only.""",
                 build="analysis.measure.dla:DirectLogitDetector", needs_text=True, decoder_only=True,
                 signed=True),
    DetectorSpec("retrieval", "Retrieval score (share of needle tokens the head copies, top-1 attention)",
                 "copies the needle from far back: top-1 attention on the needle token being written (long "
                 "contexts; decoders)",
                 about="""\
After Wu et al. 2024 ("Retrieval Head Mechanistically Explains Long-Context Factuality"). The model
reads long real text with a needle hidden at several depths ("The secret words are: ..." or a
number), then a question, then the needle's content as its answer (teacher-forced). At each answer
token, a head **copies** when its strongest attention (top-1) lands on the needle token being
written. Score = copies / answer tokens, averaged over lengths, depths and needles; a head at
>= 0.1 (Wu et al.'s cut) is a **retrieval head**: few heads are, and they are the ones that must
keep their whole KV cache. The answer accuracy says whether the model finds the needle at all.""",
                 build="analysis.measure.longheads:RetrievalDetector.for_options", decoder_only=True, long=True,
                 context=2048),
    DetectorSpec("streaming", "Streaming score (output change when the KV head reads only sinks + a window)",
                 "how much a KV head's output changes when it reads only sink tokens + a recent window (long "
                 "contexts; decoders)",
                 about="""\
DuoAttention's question (Xiao et al. 2024), measured cheaply: on long real text, each KV head's
attention output is computed twice for sampled queries beyond the window, once over every earlier
token and once over only the first *sinks* tokens + the *recent* latest ones (the KV plan's window).
Score = relative change of the output, ||full - windowed|| / ||full||, per KV head (its query heads
show the same value). Near 0: a **streaming head**, it can be windowed and its KV cache stops growing;
>= 0.5: at least half its output comes from far back, keep it full. `headscope kv-plan` windows the
lowest-scoring KV heads.""",
                 build="analysis.measure.longheads:StreamingDetector.for_options", decoder_only=True, long=True,
                 context=2048),
    DetectorSpec("retrieval-aware", "Retrieval-aware score (needle answer log-probability lost when the KV head "
                                    "alone reads only sinks + a window)",
                 "how much of a needle answer's log-probability windowing the KV head alone loses (long contexts; "
                 "decoders; L x KV heads passes, slow)",
                 about="""\
DuoAttention's criterion (Xiao et al. 2024), measured head by head. The model reads long real text
with a needle hidden where the window cannot see it from the answer ("The secret words are: ..." or a
number; the retrieval score's rows, kept only when the needle lies outside the first *sinks* tokens and
the *recent* latest ones of every answer row), then the question and the needle's content as the
answer (teacher-forced). For every KV head alone, the model runs again with only that head reading the
window (the KV plan's own mechanism) and the answer's log-probability is compared with the dense
model's. Score = nats lost, averaged over the rows (each query head shows its KV head's value). Near 0:
the answers do not notice, window it; >= ln 2 = 0.69: windowing that head alone at least halves the
answer's probability, keep it full. Unlike the streaming score (output change on plain text) it asks
the answer itself; it costs about 1 + KV heads x (layers + 1) / 2 forward passes per row (prefix reuse).
`headscope kv-plan --window-score retrieval-aware` windows the lowest-scoring KV heads.""",
                 build="analysis.measure.retrieval_aware:RetrievalAwareDetector.for_options", decoder_only=True,
                 long=True, context=2048),
):
    register_detector(_spec)
del _spec


