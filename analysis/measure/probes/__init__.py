"""Capability probes: what a model can do, what a cut breaks, which heads carry each behaviour.

- registry.py: one record per probe (`ProbeSpec`), registered once; `PROBES`; the built-in records,
  each naming its class lazily ("module:Class"), and the probes' shared options. Light: importing this
  package imports neither torch nor transformers (the CLI's parser and `probes --list` read it).
- items.py: items (prompt, read-out position, correct token, contrast), built offline and seeded,
  checked against the tokenizer.
- language.py (IOI, agreement, anaphor), copying.py, code.py, successor.py: the built-in probes' classes
  (imported the first time a probe is built).
- measure.py: logit difference and accuracy under any mask, with bootstrap CIs.
- circuit.py: a probe's per-head map through the fast ablation sweep (analysis.measure.ablation).
- breaks.py: "what this cut breaks" (dense vs cut, per probe, the lost capabilities flagged).

Adding a probe: a `Probe` subclass with `drafts` in a module of this package, and one record in
registry.py's built-in list, `ProbeSpec(name, label, help, source, "analysis.measure.probes.<module>:<Class>")`
(docs/ARCHITECTURE.md, "How to add a capability probe").
"""
from analysis.measure.probes.registry import PROBES, ProbeSpec, applicable, check_applies, chosen, probe_spec, register_probe

__all__ = ["PROBES", "ProbeSpec", "applicable", "check_applies", "chosen", "probe_spec", "register_probe"]
