"""Captured FLOPs of whole recipe train steps against XLA's compiled count (issue: ≤ 2%)."""

import pytest

from integrations.flax import capture, xla_flops
from recipes import get_recipe


@pytest.mark.parametrize(
    ("name", "batch", "seq"),
    [
        ("gpt2-small", 8, 1024),
        ("gpt-1.3b", 8, 2048),  # abstract only: 5.3 GB of parameters never allocated
        ("mamba-130m", 2, 1024),
    ],
)
def test_train_step_flops_within_2_percent_of_xla(name, batch, seq):
    recipe = get_recipe(name)
    state, data = recipe.abstract_state(), recipe.batch_spec(batch, seq)
    graph = capture(recipe.train_step, state, data)
    truth = xla_flops(recipe.train_step, state, data)
    rel = graph.total_flops() / truth.flops - 1
    print(f"{name}: captured {graph.total_flops():.4e}, XLA {truth.flops:.4e} (raw {truth.raw_flops:.4e}), {rel:+.3%}")
    assert abs(rel) <= 0.02
    assert graph.param_bytes == 4 * recipe.config.param_count()
    assert not graph.meta["unknown_primitives"]
