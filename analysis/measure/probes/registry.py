"""The probe registry: one record per probe (name, label, help, source, the model kinds it applies to,
its class), registered once with `register_probe`; everything that lists probes (the CLI's choices,
the app's panels, the reports, docs) reads `PROBES`, so a new probe is one class and one record.

Applicability: every probe reads a language model's predictions over its vocabulary, so it needs an
LM head: causal LMs get the next-token version, masked LMs the masked-token version (each built-in
probe has both); an encoder without an LM head (the built-in all-MiniLM-L6-v2) gets none, and asking
for one is one clear line (`check_applies`).
"""
from __future__ import annotations

from dataclasses import dataclass

from analysis.core.errors import InputError
from analysis.core.registry import Registry

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
    cls: type                      # the Probe subclass (analysis.measure.probes.items.Probe); verb: build
    kinds: tuple[str, ...] = LM_KINDS
    chance: float = 0.5            # accuracy of a model that cannot tell the answer from the contrast
    long: bool = False             # a long-context probe: never in the default set (module docstring)

    def make(self, **options):
        """The probe object with `options` (the ones its constructor takes; others ignored), named by
        this record (the seed's stream and every message use its name and label)."""
        import inspect
        accepted = set(inspect.signature(self.cls.__init__).parameters) - {"self"}
        probe = self.cls(**{k: v for k, v in options.items() if k in accepted and v is not None})
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
