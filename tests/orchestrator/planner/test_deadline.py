"""The hard time limit: a :class:`Deadline` on a fake clock stops the cost table, the search and the diagnosis."""

import pytest

from orchestrator.bench._synthetic import SyntheticCosts, SyntheticLayer, synthetic_cluster
from orchestrator.planner import Deadline, DeadlineExceeded, PlanInfeasible, PlanNotFound, plan
from orchestrator.planner._diagnose import infeasibility_message
from orchestrator.planner._groups import GroupConfig
from orchestrator.planner._space import microbatch_counts, search_space

BLOCK = SyntheticLayer(flops=4e12, param_bytes=2e9, activation_per_sample=0.5e9, output_per_sample=0.05e9)


class FakeClock:
    """A clock that moves only when told to (``now``), or by ``step`` each time it is read."""

    def __init__(self, step: float = 0.0):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _model(memory_gb: float = 40.0, layers: int = 4):
    return SyntheticCosts([BLOCK] * layers, synthetic_cluster({"gpu": (20.0, memory_gb)}, per_host=4))


def test_a_deadline_runs_on_its_clock():
    clock = FakeClock()
    deadline = Deadline.after(5.0, clock=clock)
    assert deadline.left() == 5.0 and not deadline.expired()
    deadline.check()
    clock.now = 5.0
    assert deadline.expired()
    with pytest.raises(DeadlineExceeded, match="5 s"):
        deadline.check()
    assert Deadline.after(5.0, clock=FakeClock()).earlier_by(5.0).expired()


def test_the_cost_table_checks_the_deadline_before_each_entry_it_computes():
    space = search_space(_model(), 64, recompute=False)
    table, group = space.table, GroupConfig(device_type="gpu", size=1, tp=1, recompute=False)
    clock = FakeClock()
    with table.bounded(Deadline.after(1.0, clock=clock)):
        computed = table.entry(0, group, 8)
        clock.now = 2.0
        assert table.entry(0, group, 8) is computed  # computed before the deadline: still read
        with pytest.raises(DeadlineExceeded):
            table.entry(0, group, 4)  # a new entry past it
        with pytest.raises(DeadlineExceeded):
            table.state_bytes(0, "gpu")
    assert table.deadline is None
    table.entry(0, group, 4)  # outside the block, no deadline


def test_an_expired_deadline_gives_no_plan_found_within_the_limit():
    clock = FakeClock()
    deadline = Deadline.after(5.0, clock=clock)
    clock.now = 6.0
    with pytest.raises(PlanNotFound, match=r"no plan found within 5 s .*raise time_limit_s"):
        plan(_model(), global_batch=8, deadline=deadline)


def test_a_deadline_that_passes_during_the_search_returns_the_incumbent_with_an_unknown_gap(monkeypatch):
    import orchestrator.planner._driver as driver

    clock = FakeClock()

    def out_of_time(*args, **kwargs):  # the search passes its deadline after the first incumbent
        clock.now = 100.0
        raise DeadlineExceeded(5.0)

    monkeypatch.setattr(driver, "column_bounds", out_of_time)
    found = plan(_model(), global_batch=8, deadline=Deadline.after(5.0, clock=clock))
    assert found.iteration_s > 0
    assert (found.bound, found.gap, found.status) == (0.0, 1.0, "Time limit reached")


def test_the_infeasibility_diagnosis_says_what_the_deadline_left_unproven():
    model = _model(memory_gb=6.0)  # 8 GB of weights, 32 GB with gradients and optimizer state, on 4 × 6 GB
    space = search_space(model, 8, recompute=True)
    args = (model, space, microbatch_counts(8), 4, "1f1b", 8)
    clock = FakeClock()
    expired = Deadline.after(5.0, clock=clock)
    clock.now = 6.0
    assert "time limit ran out before the least extra memory" in infeasibility_message(*args, deadline=expired)
    assert "the least extra memory that makes a plan exist is" in infeasibility_message(*args)
    with pytest.raises(PlanInfeasible, match="memory constraint binds"):
        plan(model, global_batch=8, time_limit_s=30)
