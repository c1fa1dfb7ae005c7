"""The README's code runs: the quick starts on a user's own Flax (linen and nnx) and Hugging Face models, the
function-DAG example (in docs/dag.md) and the cluster file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def _first_python_block_after(heading: str, text: str = README) -> str:
    block = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


def _run(code: str) -> dict:
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def _jit_losses(train_step, state, batch, steps: int) -> list[float]:
    step, losses = jax.jit(train_step), []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses


def test_readme_quick_start_trains_linen_and_nnx_models_like_jit():
    """Both models are planned for the 8 local CPU devices and train 5 steps as plain ``jax.jit`` does."""
    namespace = _run(_first_python_block_after("## Quick start: your own Flax model"))
    batch = namespace["batch"]
    for run, state, losses in (
        (namespace["run"], namespace["state"], namespace["losses"]),  # TrainState.create: a Python int step
        (namespace["nnx_run"], namespace["nnx_state"], namespace["nnx_losses"]),
    ):
        assert run.cluster.name == "local" and len(run.cluster.devices()) == 8
        assert sorted(i for stage in run.plan.stages for i in stage.layers) == list(range(len(run.layers)))
        assert run.steps_done == len(losses) == 5
        reference = _jit_losses(run.train_step, state, batch, 5)  # the README's state is left as it was
        np.testing.assert_allclose(losses, reference, rtol=1e-5)
        assert losses[-1] < losses[0]
    assert isinstance(namespace["state"].step, int)
    assert namespace["optimizer"].tx is not None and len(namespace["nnx_run"].plan.stages) == 1
    assert namespace["nnx_run"].plan.notes[0].startswith("one stage: its state (dict) has no apply_gradients")


_HF_CHECK = """
import json, sys, torch, transformers
namespace = {"__name__": "__main__"}
exec(compile(sys.stdin.read(), "README.md", "exec"), namespace)
torch.manual_seed(0)  # the same model again, trained eagerly on one device
model = transformers.GPT2LMHeadModel(namespace["config"])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
reference = []
for tokens, targets in namespace["batches"]:
    optimizer.zero_grad()
    loss = namespace["loss_fn"](model(tokens), targets)
    loss.backward()
    optimizer.step()
    reference.append(loss.item())
planned = namespace["model"]
tied = planned.lm_head.weight is planned.transformer.wte.weight
print(json.dumps({"losses": namespace["losses"], "reference": reference, "tied": tied}))
"""


def test_readme_hugging_face_quick_start_trains_like_eager():
    pytest.importorskip("transformers", reason="transformers is in the dev extra")
    pytest.importorskip("torch_xla", reason="torch_xla is in the torch extra")
    block = _first_python_block_after("## Quick start: a Hugging Face model")
    # torch_xla reads its device count when it starts: a fresh process, without this one's jax flags
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run(
        [sys.executable, "-c", _HF_CHECK],
        input=block,
        env={**env, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 3 and result["tied"]
    np.testing.assert_allclose(result["losses"], result["reference"], rtol=1e-5)


def test_dag_example_runs_on_dask():
    namespace = _run(_first_python_block_after("This block runs as is", (ROOT / "docs" / "dag.md").read_text()))
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
