"""The long-context measurements' declared defaults and bounds, light (no torch): what the CLI's parser
(`roles`, `kv-plan`, `longctx`) and the app's inputs read without importing the measurements themselves
(analysis/measure/longheads.py, analysis/score/kvscores.py import them from here).

The window (sinks + recent) and its defaults are analysis.arch.window's (one value for every measurement and plan).
"""
from analysis.core.placement import PASS_PRECISIONS  # noqa: E402 (light: no torch)

RETRIEVAL_LENGTHS = (1024, 2048)     # tokens per retrieval item (the whole row) when none are given
STREAMING_LENGTHS = (2048,)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_NEEDLES = 2                  # needles per (length, depth): words, then a number, alternating
MAX_NEEDLES = 256
DEFAULT_QUERIES = 64                 # query rows sampled beyond the window, per sequence
MAX_QUERIES = 4096
DEFAULT_SEQUENCES = 1                # haystacks the streaming score reads
MAX_SEQUENCES = 64
RETRIEVAL_THRESHOLD = 0.1            # Wu et al. 2024: a retrieval head copies >= 10 % of the needle
STREAMING_THRESHOLD = 0.5            # at least half the output (relative L2) comes from outside the window
DEFAULT_PRUNE_TOKENS = 256           # tokens of built-in text for the KV-group ablation a plan prunes by

# the retrieval-aware score (analysis.measure.retrieval_aware): each KV head windowed alone, the needle answers'
# log-probability lost
RETRIEVAL_AWARE_LENGTHS = (2048,)
RETRIEVAL_AWARE_THRESHOLD = 0.6931471805599453   # ln 2 nats: windowing the head alone halves the answer's probability
RETRIEVAL_AWARE_BATCH = 4            # rows per forward pass (needle rows x KV heads windowed)
MAX_BATCH = 256

# the per-KV-head scores a KV plan windows by, lowest first (detector names: analysis.measure.detector_registry)
WINDOW_SCORES = ("streaming", "retrieval-aware")
DEFAULT_WINDOW_SCORE = "streaming"
PLAN_SEARCHES = ("greedy",)          # searches that choose a whole plan (analysis.score.plansearch registers each)
DEFAULT_SEARCH_BLOCK = 8             # KV heads the greedy search tries at once
DEFAULT_SEARCH_BUDGET = 0.1          # nats a row a plan may lose on the calibration answers

# the long-context probes (analysis.measure.probes.longcontext; `headscope longctx`)
PROBE_LENGTH = 1024                  # tokens per row when a long probe is run without a length
PROBE_SEQUENCES = 16                 # sequences (a key and its text) per length and depth
MIN_PROBE_SEQUENCES = 2              # two keys give 10 items, above the 8 a probe needs to report a CI
MAX_PROBE_SEQUENCES = 1024

# the Long context page's defaults (components/longprobes.py, components/longctx.py): what `headscope cache warm`
# measures, so a class's pages find it stored (analysis.score.longscan)
PAGE_PROBES = ("passkey",)           # the probes the page picks first
PAGE_LENGTH = 2048                   # tokens per row (clipped to the model's context)
PAGE_SEQUENCES = 2                   # sequences per depth: the least that gives a CI (10 items)
PAGE_IMPORTANCE_TOKENS = DEFAULT_PRUNE_TOKENS   # tokens of the KV groups' ablation a plan prunes by
PRECISION_CHOICES = PASS_PRECISIONS             # the long-context passes' precision (arch.attention.precision_block)
