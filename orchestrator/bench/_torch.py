"""The torch path end to end: plan → apply on CPU XLA devices → compare with one device and with the cost model.

For a GPT recipe trained for ``steps`` AdamW steps under DP, TP and DP×TP
(single-stage plans over all local XLA devices):

* losses and parameters against the same training in eager PyTorch on the
  CPU (one device), relative error max |a − b| / max |b| per tensor;
* the all-reduce bytes in the HLO torch_xla compiles for the steady-state
  step (the optimized module XLA dumps) against the planner's prediction,
  Σ over layers of the cost model's TP all-reduce bytes plus DP gradient
  sync bytes; other collective kinds are predicted to be absent.

With ZeRO (``DP-ZeRO``) the collectives are reported, not compared: the
planner prices a reduce-scatter and an all-gather of the gradients, XLA
emits an all-reduce of the gradients and an all-gather of the updated shards.

torch_xla must not have started in this process: run it as
``python -m orchestrator.bench._torch [--json]``, which sets
``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES`` and an HLO dump directory first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

CONFIGS = (("DP", 4, 1), ("TP", 1, 4), ("DPxTP", 2, 2))  # (name, dp, tp) on 4 devices
ZERO_CONFIGS = (("DP-ZeRO", 4, 1),)  # the same, with the optimizer moments split over "data"
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def _plan(dp: int, tp: int, batch: int, layers: int):
    from orchestrator.planner import Plan, Stage

    stage = Stage(
        layers=tuple(range(layers)),
        device_type="xla-cpu",
        devices=tuple(f"local/{i}" for i in range(dp * tp)),
        tp=tp,
        dp=dp,
        recompute=False,
        microbatch_size=batch // dp,
        time_s=0.0,
        memory_bytes=0.0,
    )
    return Plan(stages=(stage,), schedule="1f1b", microbatches=1, global_batch=batch, iteration_s=0.0)


def predicted_collective_bytes(graph, plan, param_axes, axis_rules, *, zero: bool = False) -> float:
    """The planner's collective bytes per device for one step of a one-stage ``plan`` (TP all-reduces + DP sync)."""
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel, ParallelConfig

    layers = coarsen(graph)
    cluster = load_cluster("a100x8")  # bytes do not depend on the device type or links
    device_type = next(iter(cluster.device_types))
    [stage] = plan.stages
    model = CostModel(
        graph, layers, cluster, batch_size=plan.global_batch, param_axes=param_axes, axis_rules=axis_rules
    )
    config = ParallelConfig(tp=stage.tp, dp=stage.dp, microbatch_size=stage.microbatch_size, zero=zero)
    total = 0.0
    for layer in stage.layers:
        cost = model.layer_cost(layer, device_type, config)
        total += cost.tp_allreduce_bytes * plan.microbatches + cost.dp_sync_bytes
    return total


def _reference(config, batches, lr: float, seed: int):
    """Losses and final parameters of eager single-device CPU training."""
    import torch

    from recipes.torch_gpt import GPT, loss_fn

    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(batch["inputs"]), batch["targets"])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _hlo_grab(dump: Path, at_step: int):
    """A callback keeping the optimized HLO of the largest module compiled during step ``at_step``.

    The first step compiles a program that reads the freshly uploaded state;
    the second compiles the steady-state one that every later step reuses.
    """
    from integrations.torch_xla import Callback

    class HloGrab(Callback):
        hlo: str | None = None

        def on_step_begin(self, step: int) -> None:
            self.before = set(dump.glob("*cpu_after_optimizations.txt"))

        def on_step_end(self, step: int, metrics, *, state=None) -> None:
            if step != at_step:
                return
            new = [p for p in dump.glob("*cpu_after_optimizations.txt") if p not in self.before]
            if not new:
                raise RuntimeError(f"torch_xla compiled no new module into {dump}; is XLA_FLAGS --xla_dump_to set?")
            self.hlo = max(new, key=lambda p: p.stat().st_size).read_text()

    return HloGrab()


def capture_parity(preset: str, batch: int, seq: int) -> dict:
    """Captured train-step FLOPs of the torch recipe vs the Flax recipe and ``torch.utils.flop_counter``; layers of both."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from integrations.flax import capture as capture_flax
    from integrations.torch_xla import capture
    from orchestrator.coarsen import coarsen
    from recipes import get_recipe
    from recipes.torch_gpt import GPT, loss_fn

    recipe = get_recipe(preset)
    with torch.device("meta"):
        model = GPT(recipe.config)
    tokens = torch.empty(batch, seq, dtype=torch.long, device="meta")
    graph = capture(model, tokens, tokens, loss_fn=loss_fn)
    flax_graph = capture_flax(recipe.train_step, recipe.abstract_state(), recipe.batch_spec(batch, seq))
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(tokens), tokens).backward()
    layers, flax_layers = coarsen(graph), coarsen(flax_graph)
    return {
        "torch_flops": graph.total_flops(),
        "flax_flops": flax_graph.total_flops(),
        "torch_matmul_flops": graph.total_flops(kind="matmul"),
        "flop_counter_flops": float(counter.get_total_flops()),
        "param_bytes": graph.param_bytes,
        "flax_param_bytes": flax_graph.param_bytes,
        "layers": [[layer.name, layer.flops, layer.param_bytes] for layer in layers],
        "flax_layers": [[layer.name, layer.flops, layer.param_bytes] for layer in flax_layers],
    }


def run(
    preset: str = "gpt-tiny",
    batch: int = 8,
    seq: int = 64,
    steps: int = 5,
    lr: float = 1e-3,
    *,
    config=None,
    configs: tuple[tuple[str, int, int], ...] = CONFIGS,
    zero_configs: tuple[tuple[str, int, int], ...] = (),
    checkpoint_dir: str | None = None,
) -> list[dict]:
    """Train under each of ``configs`` (name, dp, tp) and compare; returns one record per configuration.

    ``config`` (a ``GPTConfig``) overrides the preset's shape. With
    ``checkpoint_dir``, the first configuration also checkpoints its last step
    and the record says whether a restore brings the weights back.
    """
    import torch
    import torch_xla.runtime as xr

    # The autograd engine sizes its per-device queues at the first backward pass
    # of the process: the XLA runtime must be up before the reference and capture run.
    xr.use_spmd()
    xr.global_runtime_device_count()

    from integrations.flax import hlo_collective_bytes
    from integrations.torch_xla import Checkpointer, SPMDCheckpointStore, StepTimer, apply, capture, fit
    from orchestrator.costs import DEFAULT_LOGICAL_AXIS_RULES
    from recipes.torch_gpt import GPT, GPT_PRESETS, loss_fn, param_axes, synthetic_batch

    dump = Path(os.environ["ORCHESTRATOR_HLO_DUMP"])
    config = config or GPT_PRESETS[preset]
    batches = [synthetic_batch(i, batch, seq, config.vocab_size) for i in range(steps)]
    ref_losses, ref_params = _reference(config, batches, lr, seed=0)
    with torch.device("meta"):
        meta_model = GPT(config)
    example = torch.empty(batch, seq, dtype=torch.long, device="meta")
    graph = capture(meta_model, example, example, loss_fn=loss_fn)
    axes, rules = param_axes(config), DEFAULT_LOGICAL_AXIS_RULES
    n_layers = 2 + config.num_layers
    records = []
    for name, dp, tp, zero in [(*c, False) for c in configs] + [(*c, True) for c in zero_configs]:
        if dp * tp != xr.global_runtime_device_count():
            raise RuntimeError(f"{name} needs {dp * tp} devices, torch_xla sees {xr.global_runtime_device_count()}")
        plan = _plan(dp, tp, batch, n_layers)
        torch.manual_seed(0)
        model = GPT(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        step = apply(plan, model, optimizer, loss_fn=loss_fn, param_axes=axes, axis_rules=rules, zero=zero)
        timer, grab = StepTimer(warmup=0), _hlo_grab(dump, at_step=1)  # every step timed, compiles included
        callbacks = [timer, grab]
        if checkpoint_dir is not None and name == configs[0][0]:
            store = SPMDCheckpointStore(Path(checkpoint_dir) / name, model, optimizer)
            checkpointer = Checkpointer(store=store, every=steps)
            callbacks.append(checkpointer)
        history = fit(step, [(b["inputs"], b["targets"]) for b in batches], callbacks)
        losses, hlo = [h["loss"] for h in history], grab.hlo
        params = {n: p.detach().cpu() for n, p in model.named_parameters()}
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_errs = {n: float((params[n] - p).abs().max() / p.abs().max()) for n, p in ref_params.items()}
        worst = max(param_errs, key=param_errs.get)
        delta = sum(float(((params[n] - p) ** 2).sum()) for n, p in ref_params.items())
        norm = sum(float((p**2).sum()) for p in ref_params.values())
        measured = hlo_collective_bytes(hlo)
        predicted = predicted_collective_bytes(graph, plan, axes, rules, zero=zero)
        records.append(
            {
                "name": f"{preset} {name} (dp={dp}, tp={tp}), batch {batch}x{seq}, {steps} steps",
                "losses": losses,
                "reference_losses": ref_losses,
                "loss_rel_err": loss_err,
                "param_rel_err": param_errs[worst],
                "param_rel_err_by_tensor": param_errs,
                "worst_param": worst,
                "param_rel_err_global": (delta / norm) ** 0.5,
                "zero": zero,
                "predicted_all_reduce_bytes": predicted,
                "hlo_collective_bytes": measured,
                "step_times_s": timer.times_s,
            }
        )
        if checkpoint_dir is not None and name == configs[0][0]:
            records[-1]["checkpoint"] = _round_trip(checkpointer, model, params)
    return records


def _round_trip(checkpointer, model, params) -> dict:
    """Zero the trained weights, restore the newest checkpoint, compare with the weights before zeroing."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    zeroed = max(float(p.detach().abs().max().cpu()) for p in model.parameters())
    restored = checkpointer.restore()
    after = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return {
        "steps_saved": checkpointer.steps(),
        "restored_step": restored,
        "max_abs_after_zeroing": zeroed,
        "max_abs_diff_after_restore": max(float((after[n] - params[n]).abs().max()) for n in params),
    }


def _gpt_presets() -> list[str]:
    from recipes.gpt import GPT_PRESETS

    return list(GPT_PRESETS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if args.preset not in _gpt_presets():
        parser.error(f"unknown preset {args.preset!r}; choose one of: {', '.join(_gpt_presets())}")
    if "torch_xla" in sys.modules:
        raise RuntimeError("run this module in a fresh process: torch_xla is already initialised")
    with tempfile.TemporaryDirectory(prefix="orchestrator-hlo-") as dump:
        os.environ.update(
            PJRT_DEVICE="CPU",
            CPU_NUM_DEVICES="4",
            ORCHESTRATOR_HLO_DUMP=dump,
            XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=SyncTensorsGraph.*",
        )
        records = run(args.preset, args.batch, args.seq, args.steps, zero_configs=ZERO_CONFIGS)
        parity = capture_parity(args.preset, args.batch, args.seq)
    json.dump({"capture": parity, "configs": records}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
