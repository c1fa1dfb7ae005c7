"""The README's code runs: the quick start on a user's own Flax model, the function-DAG example and the cluster file."""

import math
import re
from pathlib import Path

README = (Path(__file__).parent.parent / "README.md").read_text()


def _first_python_block_after(heading: str) -> str:
    block = README[README.index(heading) :]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


def _run(code: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_readme_quick_start_plans_and_trains_a_flax_model():
    namespace = _run(_first_python_block_after("Quick start: your own Flax model"))
    run = namespace["run"]
    assert run.steps_done == 3
    layers = sorted(i for stage in run.plan.stages for i in stage.layers)
    assert layers == list(range(len(run.layers)))
    loss = float(run.step(namespace["batch"])["loss"])
    assert math.isfinite(loss)


def test_readme_dag_example_runs_on_dask():
    namespace = _run(_first_python_block_after("Scheduling plain functions"))
    assert namespace["schedule"].makespan > 0
    assert isinstance(namespace["results"]["report"], float)
    records, execution = namespace["records"], namespace["execution"]
    assert all(records[t].worker == execution.worker_of(t) for t in records)


def test_readme_cluster_file_is_a_valid_cluster():
    """The README's field-by-field cluster file loads as written: every field it shows is accepted."""
    import yaml

    from orchestrator.cluster import parse_cluster

    block = README[README.index("## Describing your cluster") :]
    cluster = parse_cluster(yaml.safe_load(re.search(r"```yaml\n(.*?)```", block, re.S).group(1)))
    assert cluster.counts_by_type() == {"a100": 15}  # 16 devices, one out of service
    assert cluster.device_types["a100"].cache_bytes == 40 * 2**20
