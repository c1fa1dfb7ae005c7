"""Replay a plan event by event: timelines, Perfetto traces, Gantt and memory charts.

Example (hand-built plan: 2 equal stages, forward 1 s, backward 2 s, 4 microbatches):

>>> from orchestrator.planner import Plan, Stage
>>> from orchestrator.simulate import simulate
>>> common = dict(layers=(0,), device_type="x", tp=1, dp=1, recompute=False, microbatch_size=1,
...               time_s=3.0, forward_s=1.0, memory_bytes=0.0)
>>> stages = (Stage(devices=("h/0",), **common), Stage(devices=("h/1",), **common))
>>> timeline = simulate(Plan(stages=stages, schedule="gpipe", microbatches=4, global_batch=4, iteration_s=15.0))
>>> timeline.iteration_s, timeline.bubble_fraction
(15.0, 0.2)
"""

from orchestrator.simulate._charts import gantt_png, memory_png
from orchestrator.simulate._engine import compare, simulate
from orchestrator.simulate._schedule import chunk_order, stage_order
from orchestrator.simulate._timeline import Event, LinkStats, MemorySeries, StageStats, Timeline
from orchestrator.simulate._trace import trace_json, write_trace

__all__ = [
    "Event",
    "LinkStats",
    "MemorySeries",
    "StageStats",
    "Timeline",
    "chunk_order",
    "compare",
    "gantt_png",
    "memory_png",
    "simulate",
    "stage_order",
    "trace_json",
    "write_trace",
]
