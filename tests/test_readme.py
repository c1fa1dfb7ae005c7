"""The README's code runs."""

import re
from pathlib import Path


def test_readme_dag_example_runs_on_dask():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme[readme.index("Scheduling plain functions") :]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["schedule"].makespan > 0
    assert isinstance(namespace["results"]["report"], float)
    records, execution = namespace["records"], namespace["execution"]
    assert all(records[t].worker == execution.worker_of(t) for t in records)
