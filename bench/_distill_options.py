"""The distillation options the recovery benches share (bench_recovery, bench_frontier): one set of
flags and the DistillConfig they make, so both benches train with the same settings by default."""
from __future__ import annotations

from analysis.compress.recover.distill import DistillConfig


def add_distill_options(parser) -> None:
    """--batch, --seq, --lr, --warmup, --temperature, --precision, --max-sequences."""
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    parser.add_argument("--max-sequences", dest="max_sequences", type=int, default=2048,
                        help="training sequences cut from the calibration split")


def distill_config(args, *, steps: int, max_seconds: float | None = None, eval_every: int = 0) -> DistillConfig:
    """The DistillConfig of the shared options with this bench's step budget."""
    return DistillConfig(steps=steps, lr=args.lr, batch_size=args.batch, seq_len=args.seq,
                         temperature=args.temperature, warmup_steps=args.warmup, precision=args.precision,
                         max_seconds=max_seconds, eval_every=eval_every, max_sequences=args.max_sequences)
