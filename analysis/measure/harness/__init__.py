"""EleutherAI's lm-evaluation-harness on a model in memory: the field's zero-shot benchmarks (BoolQ, PIQA,
HellaSwag, WinoGrande, ARC-Easy, ARC-Challenge, OpenBookQA, WikiText-2 perplexity, or any task of a local
task folder), dense vs a cut, with the harness's own standard errors. Nothing is downloaded. One module a
concept; callers import every name below from this package:

- runtime.py: lm_eval imported on demand (`installed`, `harness_missing`, `require_harness`, `tasks_folder`),
  a run's settings (`quiet`, `offline`);
- folder.py: a task folder's safety checks, before the harness reads it;
- tasks.py: `STANDARD_TASKS`, a folder's or an in-memory config's tasks built and checked (`prepare_tasks`,
  `prepare_configs`, `PreparedTasks`), `request_tokens`;
- generation.py: the harness's prompts and stop rules, `generate_greedy` over analysis.measure.decode and
  `generate_rows` (a left-padded batch) over analysis.measure.decode_rows;
- lm.py: HFLM subclassed for progress, Stop and headscope's generations; the perplexity memory guard;
- runs.py: `run_harness`, `HarnessRun`, `worse`, `harness_report` / `HarnessReport`, `generation_batch_for`.
"""
from analysis.measure.harness.generation import (Generated, eos_ids, generate_greedy, generate_rows,
                                                 generation_rules, prompt_encoding, prompt_ids)
from analysis.measure.harness.runs import (DEFAULT_BATCH_SIZE, DEFAULT_GENERATION_BATCH, WORSE_STDERRS, HarnessReport,
                                           HarnessRun, generation_batch_for, harness_report, run_harness, worse)
from analysis.measure.harness.runtime import (HARNESS_REQUIREMENT, HARNESS_VERSION, harness_missing, installed, offline,
                                              quiet, require_harness, tasks_folder)
from analysis.measure.harness.tasks import (STANDARD_TASKS, PreparedTasks, StandardTask, TaskSource, check_task_names,
                                            folder_tasks, known_tasks, prepare_configs, prepare_tasks, request_tokens)

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_GENERATION_BATCH", "HARNESS_REQUIREMENT", "HARNESS_VERSION", "STANDARD_TASKS", "WORSE_STDERRS",
           "Generated", "HarnessReport", "HarnessRun", "PreparedTasks", "StandardTask", "TaskSource",
           "check_task_names", "eos_ids", "folder_tasks", "generate_greedy", "generate_rows", "generation_batch_for", "generation_rules", "harness_missing",
           "harness_report", "installed", "known_tasks", "offline", "prepare_configs", "prepare_tasks",
           "prompt_encoding", "prompt_ids", "quiet", "request_tokens", "require_harness", "run_harness",
           "tasks_folder", "worse"]
