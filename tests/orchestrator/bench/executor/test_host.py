"""The host-cost model of the executor bench: lookups, and the measurements on the 8 virtual devices."""

import math

import jax
import jax.numpy as jnp
import pytest

from orchestrator.bench.executor._host import HostCosts, blocking_share, dispatch_seconds, slowdown, wake_seconds


def costs(**slowdown_by_k) -> HostCosts:
    return HostCosts(
        dispatch_s={1: 5e-6, 2: 70e-6, 8: 120e-6},
        buffer_s=1e-6,
        blocking={1: 0.0, 2: 0.4, 8: 0.8},
        slowdown={int(k[1:]): v for k, v in slowdown_by_k.items()},
    )


def test_slowdown_is_interpolated_between_measured_counts_and_proportional_beyond():
    host = costs(k2=1.5, k4=2.5, k8=5.0)
    assert host.slow(1) == 1.0
    assert host.slow(2) == 1.5
    assert host.slow(3) == pytest.approx(2.0)
    assert host.slow(6) == pytest.approx(3.75)
    assert host.slow(16) == pytest.approx(10.0)


def test_dispatch_wake_and_blocking_take_the_next_measured_mesh_size():
    import dataclasses

    host = costs(k2=1.5)
    assert host.wake(4) == 0.0  # not measured
    host = dataclasses.replace(host, wake_s={1: 100e-6, 8: 200e-6})
    assert host.wake(1) == 100e-6 and host.wake(2) == 200e-6
    assert host.dispatch(1) == 5e-6
    assert host.dispatch(4) == 120e-6  # no 4 measured: the next size up
    assert host.dispatch(16) == 120e-6  # beyond the largest: the largest
    assert host.blocked(2) == 0.4


def test_slowdown_is_measured_for_each_count_above_one():
    # how much slower k devices on the shared cores run is the bench's figure (``slowdown_rounds``);
    # here only what the measurement returns
    x = jnp.ones((128, 128), jnp.float32)
    s = slowdown(lambda x: (x @ x) @ x, x, counts=(1, 2, 8), repeats=3)
    assert set(s) == {2, 8}
    assert all(math.isfinite(v) and v > 0 for v in s.values())


def test_measured_dispatch_wake_and_blocking_are_well_formed():
    busy = jax.jit(lambda x: (x @ x) @ x)
    x = jnp.ones((256, 256), jnp.float32)
    wake = wake_seconds(2, lambda: busy(x), repeats=5)
    assert math.isfinite(wake) and wake >= 0
    dispatch = dispatch_seconds(1, repeats=20)
    assert math.isfinite(dispatch) and dispatch > 0
    assert 0 <= blocking_share(2, dispatch_seconds(2, repeats=20), n=128, repeats=5) <= 1
    assert len(jax.devices()) >= 8


def test_slowdown_of_one_device_alone_is_one_by_definition():
    # a plan whose stages are all one device asks for no s(k) (the bench passes the counts above 1)
    assert slowdown(lambda x: x + 1, jnp.ones(4), counts=()) == {}
    assert slowdown(lambda x: x + 1, jnp.ones(4), counts=(1,)) == {}


def test_self_agreement_compares_odd_rounds_with_even_ones():
    from orchestrator.bench.executor import self_agreement

    assert self_agreement([10.0, 12.0, 10.0, 12.0]) == pytest.approx(0.2)
    assert self_agreement([3.0, 3.0]) == 0.0
    with pytest.raises(ValueError, match="at least 2 rounds"):
        self_agreement([1.0])


def test_a_stage_pays_one_program_boundary_less_per_extra_layer_and_is_slowed_by_its_device_count():
    import dataclasses

    from orchestrator.bench.executor import Setup, check_plan
    from orchestrator.bench.executor._model import device_seconds, slowed_seconds

    host = dataclasses.replace(costs(k2=1.5, k4=2.5, k8=5.0), boundary_s=0.25)
    su = Setup(None, None, None, None, "cpu", 2, None, {}, {}, host)
    [dp8] = check_plan("DP8", global_batch=16).stages  # 4 layers on 8 devices
    first, head = check_plan("2 stages (3+1) x 4 mb", global_batch=16).stages  # 3 layers on 4, 1 layer on 4
    assert device_seconds(3.0, dp8, su) == pytest.approx(3.0 - 3 * 0.25)
    assert slowed_seconds(3.0, dp8, su) == pytest.approx((3.0 - 3 * 0.25) * 5.0)
    assert slowed_seconds(3.0, first, su) == pytest.approx((3.0 - 2 * 0.25) * 2.5)
    assert slowed_seconds(3.0, head, su) == pytest.approx(3.0 * 2.5)  # one layer: no boundary saved
    assert device_seconds(0.5, dp8, su) == 0.0  # never below nothing


def test_the_host_prepares_the_backward_while_the_devices_run_the_forward(monkeypatch):
    import dataclasses

    import orchestrator.bench.executor._model as bench
    from orchestrator.bench.executor import Setup, check_plan
    from orchestrator.bench.executor._model import predicted_stage_seconds

    class Model:
        tensor_parallel = True

    su = Setup(None, None, None, Model(), "cpu", 2, None, {}, {}, costs(k2=1.5, k4=2.5, k8=5.0))
    plan = check_plan("DP8", global_batch=16)
    # forward 1 ms, backward 3 ms at one device's speed, no fixed part: D = 4 ms · s(8) = 20 ms, D_f = 5 ms
    monkeypatch.setattr(bench, "_stage_costs", lambda plan, su: [(1e-3, 3e-3, 0.0, 0.0)])
    call = 120e-6  # d(8)
    # a short backward call: hidden behind the forward's 5 ms on the devices
    [t] = predicted_stage_seconds(plan, su, buffers=[3000], forward_buffers=[1000])
    assert t == pytest.approx(call + 1000e-6 + 20e-3)
    # a backward call longer than the forward's device time: the devices wait for it
    [t] = predicted_stage_seconds(plan, su, buffers=[9000], forward_buffers=[1000])
    assert t == pytest.approx(call + 1000e-6 + (call + 8000e-6) + 15e-3)
    # the first call waits for its devices' threads to wake
    woken = dataclasses.replace(su, host=dataclasses.replace(su.host, wake_s={8: 200e-6}))
    [t] = predicted_stage_seconds(plan, woken, buffers=[3000], forward_buffers=[1000])
    assert t == pytest.approx(call + 200e-6 + 1000e-6 + 20e-3)
