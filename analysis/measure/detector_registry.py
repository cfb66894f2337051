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
):
    register_detector(_spec)
del _spec


