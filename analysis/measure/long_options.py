"""The long-context measurements' declared defaults and bounds, light (no torch): what the CLI's parser
(`roles`, `kv-plan`) and the app's inputs read without importing the measurements themselves
(analysis/measure/longheads.py, analysis/score/kvscores.py, analysis/score/kvplan.py import them from here).

The window band (sinks + recent, analysis.arch.spans's rule) has one default for every measurement and plan.
"""
DEFAULT_SINKS = 4                    # first tokens a windowed KV head keeps (attention sinks)
DEFAULT_RECENT = 256                 # latest tokens it keeps, the query's own included
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
