"""Hugging Face ``transformers`` models through capture, coarsen, plan and ``apply``, with configs built in code.

The torch_xla part runs once, in a fresh process (``_transformers_worker``):
torch_xla needs ``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES=4`` set before it
starts, and this process runs jax with 8 host devices.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")

from integrations.torch_xla import capture  # noqa: E402
from orchestrator.coarsen import coarsen  # noqa: E402
from tests.integrations.torch_xla._transformers_worker import CONFIGS, build, loss_fn  # noqa: E402

MODELS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def worker():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_DEVICE", "CPU_NUM_DEVICES")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integrations.torch_xla._transformers_worker", *MODELS],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("config", [name for name, *_ in CONFIGS])
@pytest.mark.parametrize("kind", MODELS)
def test_training_equals_single_device_and_ties_hold(worker, kind, config):
    record = worker[kind]["configs"][config]
    assert len(record["losses"]) == 3
    assert record["loss_rel_err"] <= 1e-5
    assert record["param_rel_err_global"] <= 1e-5
    assert record["tied"]  # lm_head.weight is the embedding's weight
    assert record["params_before"] == record["params_after"] == record["optimizer_params"]
    assert record["optimizer_holds_module_params"]


@pytest.mark.parametrize("kind", MODELS)
def test_default_attention_is_captured_coarsened_and_planned(worker, kind):
    record = worker[kind]
    assert record["attention"] == "sdpa" and record["tied_before"]
    assert len(record["layers"]) == 4 and record["repeated"] == [[1, 2]]
    assert record["unknown_primitives"] == {}
    assert sorted(i for stage in record["planned_layers"] for i in stage) == [0, 1, 2, 3]
    assert record["xla_capture_equals_cpu"]


def test_cpu_capture_equals_meta_capture():
    """Without dropout, sdpa takes the CPU flash kernel, whose output strides the export does not predict."""
    model, _ = build("gpt2")
    model.eval()
    tokens = torch.randint(64, (4, 12))
    graph = capture(model, tokens, tokens, loss_fn=loss_fn)
    with torch.device("meta"):
        meta_model, _ = build("gpt2")
    meta_tokens = torch.empty(4, 12, dtype=torch.long, device="meta")
    assert capture(meta_model.eval(), meta_tokens, meta_tokens, loss_fn=loss_fn) == graph


def test_allocations_are_not_compute():
    model, _ = build("gpt2")
    model.config.attn_pdrop = 0.1
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.1  # dropout masks are allocated with empty_permuted
    tokens = torch.randint(64, (4, 12))
    graph = capture(model.train(), tokens, tokens, loss_fn=loss_fn)
    allocations = [op for op in graph.ops() if op.primitive == "aten.empty_permuted"]
    assert allocations and all(op.flops == 0 and op.kind == "data_movement" for op in allocations)
    assert graph.meta["unknown_primitives"] == {}


def test_gpt2_xl_on_meta_is_embedding_48_blocks_and_head():
    layers_count, d_model, seq = 48, 1600, 1024
    config = transformers.GPT2Config(n_layer=layers_count, n_embd=d_model, n_head=25, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    tokens = torch.empty(1, seq, dtype=torch.long, device="meta")
    graph = capture(model, tokens, tokens, loss_fn=loss_fn)
    layers = coarsen(graph)
    names = [layer.name for layer in layers]
    assert len(layers) == layers_count + 2
    assert names[1:-1] == [f"GPT2LMHeadModel/transformer/h_{i}" for i in range(layers_count)]
    assert names[0].startswith("GPT2LMHeadModel/transformer/wte") and names[-1].endswith("lm_head")
    assert list(layers.repeated().values()) == [list(range(1, layers_count + 1))]
    # Kaplan et al. (2020): 6·N per token, plus 12·L·T·d per token for attention scores and mixing
    params = sum(p.numel() for p in model.parameters())
    expected = (6 * params + 12 * layers_count * seq * d_model) * seq
    training = graph.total_flops(phase="forward") + graph.total_flops(phase="backward")
    assert training == pytest.approx(expected, rel=0.02)
