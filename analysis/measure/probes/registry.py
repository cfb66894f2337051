"""The probe registry: one record per probe (name, label, help, source, the model kinds it applies to,
its class), registered once with `register_probe`; everything that lists probes (the CLI's choices and
`probes --list`, the app's panels, the reports, docs) reads `PROBES`, so a new probe is one class and
one record.

Declarations apart from implementations: this module imports neither torch nor transformers, so the
CLI's parser reads it for free. The built-in records at the bottom name their class lazily,
"analysis.measure.probes.<module>:<Class>" (`analysis.core.registry.load`), imported the first time a
probe is built (`ProbeSpec.probe_class`); a record registered at run time may hold the class itself.
The probes' shared options (items per probe, what a causal prompt starts with) are declared here too.

Applicability: every probe reads a language model's predictions over its vocabulary, so it needs an
LM head: causal LMs get the next-token version, masked LMs the masked-token version (each built-in
probe has both); an encoder without an LM head (the built-in all-MiniLM-L6-v2) gets none, and asking
for one is one clear line (`check_applies`).
"""
from __future__ import annotations

from dataclasses import dataclass

from analysis.core.errors import InputError
from analysis.core.registry import Registry, resolved, taken_keywords

MIN_ITEMS = 8            # a probe with fewer scored items says so instead of reporting a CI
DEFAULT_ITEMS = 48
MAX_ITEMS = 4096
BOS_CHOICES = ("auto", "none", "bos", "eos")    # what a causal prompt starts with (items.Probe's `bos`)

LM_KINDS = ("causal-lm", "masked-lm")
KIND_WORDS = {"causal-lm": "a causal language model", "masked-lm": "a masked language model",
              "encoder": "an encoder without a language-model head"}


@dataclass(frozen=True)
class ProbeSpec:
    """What headscope knows about one probe, in one place."""
    name: str                      # the CLI / URL name
    label: str                     # shown in tables and panels
    help: str                      # one line: what it tests
    source: str                    # where the task comes from
    cls: type | str                # the Probe subclass (analysis.measure.probes.items.Probe; verb: build), or
                                   # its reference "package.module:Class", imported on first use
    kinds: tuple[str, ...] = LM_KINDS
    chance: float = 0.5            # accuracy of a model that cannot tell the answer from the contrast
    long: bool = False             # a long-context probe: never in the default set (module docstring)

    @property
    def probe_class(self) -> type:
        """The Probe subclass (imported now when `cls` is its reference)."""
        return resolved(self.cls)

    def make(self, **options):
        """The probe object with `options` (the ones its constructor takes; others ignored), named by
        this record (the seed's stream and every message use its name and label)."""
        cls = self.probe_class
        accepted = taken_keywords(cls)
        probe = cls(**{k: v for k, v in options.items() if k in accepted and v is not None})
        probe.name, probe.label = self.name, self.label
        return probe


PROBES: Registry = Registry("probe")


def register_probe(spec: ProbeSpec) -> ProbeSpec:
    """Add a probe; InputError for an empty or taken name (the same record again is a no-op)."""
    if not spec.name:
        raise InputError("A probe needs a name.")
    return PROBES.add(spec.name, spec)


def probe_spec(name: str) -> ProbeSpec:
    """The registered probe; InputError naming the choices otherwise."""
    return PROBES.of(name)


def applicable(kind: str, *, long: bool | None = False) -> list[str]:
    """The registered probes that apply to a model of this kind (possibly none): the short ones (long=False,
    the default set), the long-context ones (long=True) or both (long=None)."""
    return [name for name, spec in PROBES.items() if kind in spec.kinds and long in (None, spec.long)]


def check_applies(name: str, kind: str) -> ProbeSpec:
    """The probe's record, or InputError in one line when it does not apply to this kind of model."""
    spec = probe_spec(name)
    if kind not in spec.kinds:
        raise InputError(f"The {spec.label} probe needs {' or '.join(KIND_WORDS[k] for k in spec.kinds)}; this model "
                         f"is {KIND_WORDS.get(kind, kind)}, which predicts no tokens (all-MiniLM-L6-v2 has no MLM "
                         f"head). Probe a causal or masked language model instead.")
    return spec


def chosen(names, kind: str) -> list[str]:
    """`names` (None or "all": every short probe that applies; long-context probes only by name) checked
    against the model kind."""
    if names is None or "all" in names:
        picked = applicable(kind)
        if not picked:
            raise InputError(f"No probe applies to {KIND_WORDS.get(kind, kind)}: every probe reads predicted "
                             f"tokens, and this model has no language-model head.")
        return picked
    return [check_applies(n, kind).name for n in dict.fromkeys(names)]


def long_chosen(names, kind: str | None = None) -> list[str]:
    """`names` (None or "all": every long-context probe) checked: each must be a long-context probe (and,
    given the model's kind, apply to it); InputError in one line otherwise (a short probe's name says where
    it runs)."""
    every = [n for n, s in PROBES.items() if s.long]
    if names is None or "all" in names:
        picked = every if kind is None else applicable(kind, long=True)
        if not picked:
            raise InputError("No long-context probe applies to this model: they read a causal language model's "
                             "next tokens.")
        return picked
    out = []
    for n in dict.fromkeys(names):
        spec = probe_spec(n)
        if not spec.long:
            raise InputError(f"{spec.label} ({n}) is a short probe; run it with `headscope probes`. Long-context "
                             f"probes: {', '.join(every)}.")
        out.append(n if kind is None else check_applies(n, kind).name)
    return out


# The built-in probes: one record each; the class is named, not imported (a new probe: its class in a
# module of this package, and one record here; docs/ARCHITECTURE.md, "How to add a capability probe").
_HERE = "analysis.measure.probes"
for _spec in (
    ProbeSpec("ioi", "Indirect object (IOI)",
              "who receives: 'When Mary and John went to the store, John gave a drink to' -> Mary, not John",
              "Wang et al. 2022, 'Interpretability in the Wild' (the task; templates and names written for headscope)",
              f"{_HERE}.language:IOIProbe"),
    ProbeSpec("agreement", "Subject-verb agreement",
              "the verb agrees with the subject across an attractor: 'The keys to the cabinet' -> are, not is",
              "Linzen, Dupoux and Goldberg 2016, 'Assessing the Ability of LSTMs to Learn Syntax-Sensitive "
              "Dependencies' (the task; nouns and prepositions written for headscope)",
              f"{_HERE}.language:AgreementProbe"),
    ProbeSpec("anaphor", "Anaphor agreement",
              "a reflexive agrees with its subject: 'Yesterday, the queen hurt' -> herself, not himself",
              "Warstadt et al. 2020, 'BLiMP' (its anaphor gender / number agreement paradigms, as minimal pairs "
              "written for headscope)",
              f"{_HERE}.language:AnaphorProbe"),
    ProbeSpec("copying", "In-context copying",
              "continue a repeated random sequence from its first copy (induction; with the in-context-learning "
              "score)",
              "Olsson et al. 2022, 'In-context Learning and Induction Heads' (repeated random tokens, as the "
              "induction detector reads them)",
              f"{_HERE}.copying:CopyingProbe"),
    ProbeSpec("code", "Code: closing brackets and quotes",
              "close the open bracket or quote in real Python source (the interpreter's standard library, PSF "
              "License)",
              "bracket matching as a code-model capability; the source is Python's own standard library (PSF "
              "License v2)",
              f"{_HERE}.code:CodeProbe"),
    ProbeSpec("successor", "Successor sequences",
              "continue an ordered list: 'Monday, Tuesday, Wednesday,' -> Thursday, not another weekday",
              "Gould et al. 2023, 'Successor Heads' (ordinal sequences; lists written for headscope)",
              f"{_HERE}.successor:SuccessorProbe"),
    # long-context probes (rows of 1k-8k tokens): out of the default set, run by name (module docstring)
    ProbeSpec("passkey", "Pass key retrieval",
              "find a 5-digit pass key hidden in long text and repeat it digit by digit (long context)",
              "Mohtashami & Jaggi 2023, 'Landmark Attention' (the pass key retrieval task); digits read one by one",
              f"{_HERE}.longcontext:PasskeyProbe", kinds=("causal-lm",), long=True),
    ProbeSpec("passkey-once", "Pass key stated once",
              "find a 5-digit pass key stated once in long text ('The pass key is 48213. Remember it.'); the same "
              "keys and text as passkey",
              "Mohtashami & Jaggi 2023, 'Landmark Attention' (the pass key retrieval task; their needle states the "
              "key twice, this one once); digits read one by one, and the answer generated",
              f"{_HERE}.longcontext:PasskeyOnceProbe", kinds=("causal-lm",), long=True),
    ProbeSpec("needle", "Needle with a distractor",
              "give the magic number of the city asked for when another city's number is also in the long text",
              "Kamradt 2023, 'Needle in a Haystack'; Hsieh et al. 2024, 'RULER' (multi-key needles)",
              f"{_HERE}.longcontext:NeedleProbe", kinds=("causal-lm",), long=True),
    ProbeSpec("long-copying", "Long-range copying",
              "continue a random token sequence seen thousands of tokens earlier (induction at distance)",
              "Olsson et al. 2022 (repeated random tokens), the first copy placed at a depth of a long text",
              f"{_HERE}.longcontext:LongCopyingProbe", kinds=("causal-lm",), long=True),
):
    register_probe(_spec)
del _spec
