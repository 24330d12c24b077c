"""Pipeline parallelism: pure schedules (schedule.py), blocking P2P between stages (p2p.py), and the
runner that executes one rank's action list for one optimizer step (runner.py)."""
from hpcmeg.parallel.pipeline.schedule import (Action, all_ranks, bubble_fraction, chunk_layers, format_actions,
                                               interleaved, make_schedule, no_pipeline, one_f_one_b,
                                               parse_actions, schedule_advice, warmup_count)

__all__ = ["Action", "all_ranks", "bubble_fraction", "chunk_layers", "format_actions", "interleaved",
           "make_schedule", "no_pipeline", "one_f_one_b", "parse_actions", "schedule_advice",
           "warmup_count"]
