"""The binding notes a plan explains itself with."""

from types import SimpleNamespace

import pytest

from orchestrator.planner._diagnose import binding_notes
from orchestrator.planner._evaluate import Evaluation
from orchestrator.planner._groups import GroupConfig


class _Table:
    def entry(self, layer, group, microbatches):
        return SimpleNamespace(time_s=1e-3)


def _space():
    info = SimpleNamespace(memory_bytes=1e12, capacity_bytes=1e12, devices=4, per_host=4)
    return SimpleNamespace(infos={"a100": info}, table=_Table())


@pytest.mark.parametrize(
    ("microbatches", "expected"),
    [
        (1, "one microbatch: the 2 stages run one after another, none overlapping; stage 1 is the slowest (3 ms)"),
        (2, "bottleneck: stage 1 (3 ms per microbatch) sets the pace of the 1 steady-state microbatch"),
        (8, "bottleneck: stage 1 (3 ms per microbatch) sets the pace of the 7 steady-state microbatches"),
    ],
)
def test_the_pipeline_note_counts_the_microbatches_it_talks_about(microbatches, expected):
    group = GroupConfig(device_type="a100", size=2, tp=1, recompute=False)
    ev = Evaluation(True, 0.01, (2e-3, 3e-3), (1e9, 1e9), {})
    notes = binding_notes([[0], [1]], [group, group], microbatches, ev, _space())
    assert notes[0] == expected
