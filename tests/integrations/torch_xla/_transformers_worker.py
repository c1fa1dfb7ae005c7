"""Trains tiny ``transformers`` models with ``apply`` on 4 CPU XLA devices (``python -m tests.integrations.torch_xla._transformers_worker``).

For a GPT-2 and a Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query
attention), both with the head tied to the embedding and the default (sdpa)
attention: capture on CPU tensors, coarsen, plan on a 4-device cluster, then
train ``STEPS`` AdamW steps under DP4, DP2×TP2 and DP4 with ZeRO and compare
with eager single-device training; capture again from XLA tensors. torch_xla must start with
``PJRT_DEVICE=CPU`` and ``CPU_NUM_DEVICES=4``, which the pytest process
(jax with 8 host devices) cannot give it. Prints one JSON line.
"""

import json
import os
import sys
import tempfile

# batch·seq (96) differs from every parameter dim
BATCH, SEQ, STEPS, LR, VOCAB = 8, 12, 3, 1e-3, 64
CONFIGS = (("DP4", 4, 1, False), ("DP2xTP2", 2, 2, False), ("DP4-ZeRO", 4, 1, True))
CLUSTER = """name: cpu4
device_types:
  cpu: {peak_tflops: {float32: 1.0}, memory_bytes: 17179869184, memory_bandwidth_gbps: 50}
hosts:
- {name: cpu-0, device_type: cpu, count: 4, intra_link: {bandwidth_gbps: 10, latency_us: 5}}
network: {}
"""
# Flax-form parameter path suffix → logical axes (torch Linear weights are (out, in),
# GPT-2's Conv1D weights (in, out))
AXES = {
    "wte/weight": ("vocab", "embed"),
    "embed_tokens/weight": ("vocab", "embed"),
    "attn/c_attn/weight": ("embed", "heads"),
    "attn/c_proj/weight": ("heads", "embed"),
    "mlp/c_fc/weight": ("embed", "mlp"),
    "mlp/c_proj/weight": ("mlp", "embed"),
    "q_proj/weight": ("heads", "embed"),
    "k_proj/weight": ("heads", "embed"),
    "v_proj/weight": ("heads", "embed"),
    "o_proj/weight": ("embed", "heads"),
    "gate_proj/weight": ("mlp", "embed"),
    "up_proj/weight": ("mlp", "embed"),
    "down_proj/weight": ("embed", "mlp"),
}


def build(kind: str):
    """The model (seeded) and the names of its embedding and head weights."""
    import torch
    import transformers

    common = {"vocab_size": VOCAB, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common
        )
        return transformers.GPT2LMHeadModel(config), ("transformer.wte.weight", "lm_head.weight")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        **common,
    )
    return transformers.LlamaForCausalLM(config), ("model.embed_tokens.weight", "lm_head.weight")


def loss_fn(output, targets):
    import torch

    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def param_axes(model) -> dict:
    from integrations.torch_xla import scope_path

    axes = {}
    for name, _ in model.named_parameters():
        path = scope_path(name)
        axes[path] = next((a for suffix, a in AXES.items() if path.endswith(suffix)), None)
    return axes


def _get(model, dotted: str):
    value = model
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _optimizer(model):
    import torch

    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


def _batches():
    import torch

    generator = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def run_model(kind: str, cluster_path: str) -> dict:

    from integrations.torch_xla import apply, capture, fit
    from orchestrator.bench._torch import _plan
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel
    from orchestrator.planner import plan

    # contiguous, as they arrive on the XLA device (a strided target adds a copy to the CPU capture)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in _batches()]
    model, (embedding, head) = build(kind)
    record = {
        "attention": model.config._attn_implementation,
        "tied_before": _get(model, head) is _get(model, embedding),
    }
    optimizer = _optimizer(model)
    reference = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        reference.append(loss.item())
    reference_params = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, _ = build(kind)
    graph = capture(model, *batches[0], loss_fn=loss_fn)
    layers = coarsen(graph)
    axes = param_axes(model)
    cost_model = CostModel(graph, layers, load_cluster(cluster_path), batch_size=BATCH, param_axes=axes)
    planned = plan(cost_model, global_batch=BATCH, max_stages=1, time_limit_s=20.0)
    record.update(
        layers=[layer.name for layer in layers],
        repeated=list(layers.repeated().values()),
        unknown_primitives=graph.meta["unknown_primitives"],
        planned_layers=[list(stage.layers) for stage in planned.stages],
        graph_params=len(graph.params),
        configs={},
    )
    for name, dp, tp, zero in CONFIGS:
        model, _ = build(kind)
        optimizer = _optimizer(model)
        count = len(list(model.parameters()))
        step = apply(_plan(dp, tp, BATCH, len(layers)), model, optimizer, loss_fn=loss_fn, param_axes=axes, zero=zero)
        losses = [h["loss"] for h in fit(step, batches, [])]
        optimized = [p for group in optimizer.param_groups for p in group["params"]]
        params = {n: p.detach().cpu() for n, p in model.named_parameters()}
        delta = sum(float(((params[n] - p) ** 2).sum()) for n, p in reference_params.items())
        norm = sum(float((p**2).sum()) for p in reference_params.values())
        record["configs"][name] = {
            "losses": losses,
            "reference_losses": reference,
            "loss_rel_err": max(abs(a - b) / abs(b) for a, b in zip(losses, reference)),
            "param_rel_err_global": (delta / norm) ** 0.5,
            "tied": _get(model, head) is _get(model, embedding),
            "params_before": count,
            "params_after": len(list(model.parameters())),
            "optimizer_params": len(optimized),
            "optimizer_holds_module_params": {id(p) for p in optimized} == {id(p) for p in model.parameters()},
        }
    # the same capture from the model on the XLA device (moved as a user would, ties restored)
    import torch_xla

    model, _ = build(kind)
    model.to(torch_xla.device())
    model.tie_weights()
    device_batch = [t.to(torch_xla.device()) for t in batches[0]]
    record["xla_capture_equals_cpu"] = capture(model, *device_batch, loss_fn=loss_fn) == graph
    return record


def main() -> None:
    if "torch_xla" in sys.modules:
        raise RuntimeError("run in a fresh process")
    os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    import torch_xla.runtime as xr

    # The autograd engine sizes its per-device queues at the first backward pass
    # of the process: the XLA runtime must be up before eager training and capture.
    xr.use_spmd()
    xr.global_runtime_device_count()
    with tempfile.TemporaryDirectory(prefix="orchestrator-test-") as tmp:
        cluster_path = os.path.join(tmp, "cpu4.yaml")
        with open(cluster_path, "w") as f:
            f.write(CLUSTER)
        records = {kind: run_model(kind, cluster_path) for kind in sys.argv[1:] or ("gpt2", "llama")}
    print(json.dumps(records))


if __name__ == "__main__":
    main()
