"""Capability probes: what a model can do, what a cut breaks, which heads carry each behaviour.

- registry.py: one record per probe (`ProbeSpec`), registered once; `PROBES`.
- items.py: items (prompt, read-out position, correct token, contrast), built offline and seeded,
  checked against the tokenizer.
- language.py (IOI, agreement, anaphor), copying.py, code.py, successor.py: the built-in probes.
- longcontext.py: the long-context probes (passkey, needle, long-copying; rows of 1k-8k tokens at chosen
  depths), registered with long=True: kept out of the default set, run by name.
- measure.py: logit difference and accuracy under any mask, with bootstrap CIs.
- circuit.py: a probe's per-head map through the fast ablation sweep (analysis.measure.ablation).
- breaks.py: "what this cut breaks" (dense vs cut, per probe, the lost capabilities flagged).
- domains.py: per-head importance on two text sets, and a cut scored on one evaluated on both.

Adding a probe: a `Probe` subclass with `drafts` and one `register_probe(ProbeSpec(...))` beside it,
in a module imported below (docs/DEFINITIONS.md, "What a cut breaks").
"""
from analysis.measure.probes.registry import PROBES, ProbeSpec, applicable, check_applies, chosen, probe_spec, register_probe
from analysis.measure.probes import language, copying, code, successor, longcontext  # noqa: F401,E402  (each registers its probes)

__all__ = ["PROBES", "ProbeSpec", "applicable", "check_applies", "chosen", "probe_spec", "register_probe"]
