"""Job graphs of real functions: expansion, constraints, measurement, and execution on Dask."""

import math

import numpy as np
import pytest
from distributed import Client, LocalCluster

from orchestrator.cluster import parse_cluster
from orchestrator.dag import JobFailed, JobGraph, heft, milp, run


def workers_cluster(n: int, *, threads: int = 1, memory: int = 2**32):
    return parse_cluster(
        {
            "name": "local-workers",
            "device_types": {
                "cpu": {"peak_tflops": {"float64": 0.05}, "memory_bytes": memory, "memory_bandwidth_gbps": 10}
            },
            "hosts": [
                {
                    "name": f"w{i}",
                    "device_type": "cpu",
                    "count": 1,
                    "rack": "r",
                    "threads_per_device": threads,
                    "intra_link": {"bandwidth_gbps": 1, "latency_us": 100},
                }
                for i in range(n)
            ],
            "network": {"rack": {"bandwidth_gbps": 1, "latency_us": 200}},
        }
    )


def test_counts_expand_into_runs():
    jobs = JobGraph()
    jobs.add("sample", lambda instance: instance, exec_s=1.0)
    jobs.add("pair", lambda xs: sum(xs), deps=[("sample", 2)], exec_s=1.0)
    jobs.add("total", lambda a, b: a + b, deps=[("pair", 2), "sample"], exec_s=1.0)
    mult = jobs.multiplicity()
    assert mult == {"total": 1, "pair": 2, "sample": 4}
    instances = {i.task: i for i in jobs.instances()}
    assert instances["pair[1]"].inputs == (("sample[2]", "sample[3]"),)
    assert instances["total"].inputs == (("pair[0]", "pair[1]"), ("sample[0]",))


def test_unknown_dependency_and_duplicates_are_refused():
    jobs = JobGraph()
    jobs.add("a", int, exec_s=1.0)
    with pytest.raises(ValueError, match="not in the graph yet"):
        jobs.add("b", int, deps=["zzz"])
    with pytest.raises(ValueError, match="already in the graph"):
        jobs.add("a", int)


def test_device_and_memory_constraints_shape_the_problem():
    jobs = JobGraph()
    jobs.add("big", int, exec_s={"cpu": 2.0}, memory_bytes=3 * 2**30)
    jobs.add("pinned", int, deps=["big"], exec_s=1.0, devices=["w1/0"], output_bytes=1e9)
    with pytest.raises(ValueError, match="'big' cannot run on any device"):  # 3 GiB fits no 2 GiB thread
        jobs.problem(workers_cluster(3, threads=2, memory=4 * 2**30))
    jobs = JobGraph()
    jobs.add("big", int, exec_s={"cpu": 2.0}, memory_bytes=2**30, output_bytes=1e9)
    jobs.add("pinned", int, deps=["big"], exec_s=1.0, devices=["w1/0"])
    problem = jobs.problem(workers_cluster(3))
    assert problem.allowed("pinned") == [1]
    assert not any(math.isinf(t) for t in problem.exec_s["big"])
    # 1 GB over a 1 GB/s link, plus 1 GB of serialisation at 1 GB/s, plus 200 µs latency
    assert problem.transfer_s(("big", "pinned"), 0, 1) == pytest.approx(2.0002)
    schedule = milp(problem)
    schedule.validate()
    assert schedule.device_of("big") == schedule.device_of("pinned") == "w1/0"


def test_measure_times_and_sizes_jobs():
    jobs = JobGraph()
    jobs.add("make", lambda: np.ones(1000))
    jobs.add("use", lambda x: float(x.sum()), deps=["make"])
    jobs.measure()
    make = jobs.jobs["make"]
    assert make.exec_s["*"] > 0
    assert make.output_bytes > 8000  # a pickled array of 1000 float64


def _real_jobs() -> JobGraph:
    """20 jobs of numpy work: sources, two mixing layers, reductions, one total."""

    def source(instance):
        return np.random.default_rng(instance).standard_normal((400, 400))

    def mix(a, b):
        return np.tanh(a @ b / 400)

    jobs = JobGraph()
    jobs.add("src", source)
    jobs.add("src2", lambda x: x[::-1].T.copy(), deps=[("src", 1)])
    for i in range(6):
        jobs.add(f"mix1_{i}", mix, deps=["src", "src2"] if i % 2 else ["src2", "src"])
    for i in range(6):
        jobs.add(f"mix2_{i}", mix, deps=[f"mix1_{i}", f"mix1_{(i + 1) % 6}"])
    for i in range(5):
        jobs.add(f"mix3_{i}", mix, deps=[f"mix2_{i}", f"mix2_{i + 1}"])
    jobs.add("total", lambda *xs: float(sum(x.sum() for x in xs)), deps=[f"mix3_{i}" for i in range(5)])
    return jobs


def _serial(jobs: JobGraph) -> dict:
    from orchestrator.dag._jobs import call

    out = {}
    for inst in jobs.instances():
        args = [[out[t] for t in ps] if len(ps) > 1 else out[ps[0]] for ps in inst.inputs]
        out[inst.task] = call(jobs.jobs[inst.job].fn, args, inst.index)
    return out


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


def test_twenty_real_jobs_run_where_scheduled(client):
    jobs = _real_jobs()
    assert len(jobs.instances()) == 20
    jobs.measure()
    problem = jobs.problem(workers_cluster(3))
    schedule = milp(problem, time_limit_s=5)
    schedule.validate()
    assert schedule.makespan <= heft(problem).makespan + 1e-9
    results, records, execution = run(schedule, jobs, client)
    for task in problem.tasks:
        assert records[task].worker == execution.worker_of(task), task
    expected = _serial(jobs)
    for task, value in expected.items():
        # equal up to BLAS summation order (workers run single-threaded BLAS)
        np.testing.assert_allclose(results[task], value, rtol=1e-9, atol=1e-12)
    measured = max(r.finish_s for r in records.values()) - min(r.start_s for r in records.values())
    print(f"20 jobs on 3 workers: predicted makespan {schedule.makespan:.3f} s, measured {measured:.3f} s")
    assert measured > 0


def test_a_failing_job_is_named_and_only_it_and_its_dependents_rerun(client, tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()

    def logged(name, fn):
        def wrapped(*args):
            (calls / f"{name}-{len(list(calls.glob(name + '-*')))}").touch()
            return fn(*args)

        return wrapped

    def broken(x):
        raise ValueError("bad input")

    jobs = JobGraph()
    jobs.add("a", logged("a", lambda: 1), exec_s=1.0)
    jobs.add("b", logged("b", lambda x: x + 1), deps=["a"], exec_s=1.0)
    jobs.add("c", logged("c", broken), deps=["a"], exec_s=1.0)
    jobs.add("d", logged("d", lambda x, y: x + y), deps=["b", "c"], exec_s=1.0)
    schedule = heft(jobs.problem(workers_cluster(3)))
    with pytest.raises(JobFailed, match="job 'c' failed: ValueError: bad input") as info:
        run(schedule, jobs, client)
    execution = info.value.execution
    assert sorted(execution.completed()) == ["a", "b"]
    results, _ = execution.rerun(replace={"c": logged("c", lambda x: x * 10)})
    assert results["d"] == 2 + 10
    ran = sorted(p.name.split("-")[0] for p in calls.iterdir())
    assert ran == ["a", "b", "c", "c", "d"]  # a and b ran once; c twice; d once, after the fix
