"""``orchestrator bench fidelity``: the cost model against XLA's compiled programs.

The subject is one gpt2-small transformer block, forward and backward (a
mean-square loss on its output, gradients for its parameters and input),
batch 8 × 1024, sharded over the 8 local devices as DP8, DP4×TP2 and DP2×TP4
(Megatron tensor parallelism over heads and MLP columns, by the recipe's
logical axis names). For each sharding:

* communication: predicted bytes per collective kind vs the operand bytes of
  the collectives in the optimized HLO (tolerance 1%);
* memory: predicted per-device peak (arguments + outputs + activations +
  transient) vs ``memory_analysis()``: arguments + temporaries + outputs −
  aliases (tolerance 10%).

Needs 8 jax devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

from orchestrator.bench._case import Case

BATCH, SEQ = 8, 1024
SHARDINGS = ((8, 1), (4, 2), (2, 4))
RULES = (("batch", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"))


def _block_problem():
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from integrations.flax import param_logical_axes
    from recipes import get_recipe
    from recipes.gpt import Block

    block = Block(get_recipe("gpt2-small").config)
    x = jax.ShapeDtypeStruct((BATCH, SEQ, block.config.d_model), jnp.float32)
    boxed = jax.eval_shape(block.init, jax.random.key(0), x)["params"]

    def step(variables, x):
        loss_fn = lambda v, x: jnp.mean(block.apply(v, x) ** 2)  # noqa: E731
        loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 1))(variables, x)
        return loss, grads, dx

    variables = {"params": nn.meta.unbox(boxed)}
    return step, variables, x, {"params": nn.get_partition_spec(boxed)}, param_logical_axes(boxed)


def fidelity_cases(progress=None) -> list[Case]:
    """Run the comparisons; ``progress(description)`` is called before each sharding."""
    import flax.linen as nn
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from integrations.flax import capture, xla_program
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel, ParallelConfig

    if len(jax.devices()) < 8:
        raise RuntimeError(
            f"bench fidelity needs 8 devices, found {len(jax.devices())}: "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before starting"
        )
    step, params, x, specs, axes = _block_problem()
    graph = capture(step, params, x)
    layers = coarsen(graph, by_scope=False, fallback_layers=1)
    cluster = load_cluster("local")
    model = CostModel(graph, layers, cluster, batch_size=BATCH, param_axes=axes)
    [device_type] = cluster.device_types
    x_bytes = BATCH * SEQ * x.shape[-1] * 4

    cases = []
    for dp, tp in SHARDINGS:
        name = f"gpt2-small block DP{dp}" + (f"xTP{tp}" if tp > 1 else "")
        if progress:
            progress(name)
        mesh = jax.make_mesh((dp, tp), ("data", "model"), devices=jax.devices()[: dp * tp])
        param_sharding = nn.logical_to_mesh_sharding(specs, mesh, RULES)
        x_sharding = NamedSharding(mesh, P("data"))
        jitted = jax.jit(
            step,
            in_shardings=(param_sharding, x_sharding),
            out_shardings=(NamedSharding(mesh, P()), param_sharding, x_sharding),
        )
        measured = xla_program(jitted, params, x)
        cost = model.layer_cost(0, device_type, ParallelConfig(tp=tp, dp=dp, microbatch_size=BATCH // dp))
        predicted_ar = cost.tp_allreduce_bytes + cost.dp_sync_bytes
        cases.append(
            Case(
                name=name,
                metric="all-reduce bytes",
                predicted=predicted_ar,
                measured=measured.collective_bytes["all-reduce"],
                tolerance=0.01,
            )
        )
        for kind in ("all-gather", "reduce-scatter", "collective-permute", "all-to-all"):
            cases.append(
                Case(
                    name=name,
                    metric=f"{kind} bytes",
                    predicted=0.0,
                    measured=measured.collective_bytes[kind],
                    tolerance=0.01,
                )
            )
        boundary = x_bytes / dp  # the block's input and its gradient
        predicted_peak = cost.memory_bytes(1) + 2 * boundary
        cases.append(
            Case(
                name=name,
                metric="peak memory bytes",
                predicted=predicted_peak,
                measured=measured.peak_bytes,
                tolerance=0.10,
            )
        )
    return cases


def compute_cases(recipe_name: str = "gpt2-small", batch_size: int = 1, progress=None) -> list[Case]:
    """Per layer kind: calibrated cost-model time vs profiled CPU time (15%), and op-graph FLOPs vs XLA's (3%).

    The efficiencies are fitted to the same profile (``orchestrator.profile.calibrate``),
    so this checks how well one set of efficiencies explains every layer kind.
    """
    import jax

    from integrations.flax import SlicedStep, capture, piece_flops, profile_layers
    from orchestrator.cluster import load_cluster
    from orchestrator.coarsen import coarsen
    from orchestrator.costs import CostModel, ParallelConfig
    from orchestrator.profile import calibrate
    from recipes import get_recipe

    recipe = get_recipe(recipe_name)
    state, batch = recipe.abstract_state(), recipe.batch_spec(batch_size)
    graph = capture(recipe.train_step, state, batch)
    layers = coarsen(graph)
    timings = profile_layers(recipe.train_step, state, batch, graph=graph, layers=layers, progress=progress)
    cluster = load_cluster("local")
    [device_type] = cluster.device_types
    model = CostModel(graph, layers, cluster, batch_size=batch_size)
    pieces = []
    for timing in timings.values():
        layer = next(layer for layer in layers if layer.signature == timing.signature)
        for phase in ("forward", "backward", "optimizer"):
            ops = [graph.op(n) for n in layer.ops if graph.op(n).phase == phase]
            pieces.append((ops, getattr(timing, f"{phase}_s")))
    efficiency = calibrate(pieces, cluster.device_types[device_type], model.traffic)
    model = CostModel(graph, layers, cluster, batch_size=batch_size, efficiency={device_type: efficiency})
    sliced = SlicedStep(recipe.train_step, state, batch, graph=graph)
    cases = []
    for timing in timings.values():
        layer = next(layer for layer in layers if layer.signature == timing.signature)
        cost = model.layer_cost(layer.index, device_type, ParallelConfig(microbatch_size=batch_size))
        predicted = cost.forward_s + cost.backward_s + cost.optimizer_s
        name = f"{recipe_name} {layer.name} (batch {batch_size}, {jax.devices()[0].device_kind})"
        cases.append(
            Case(name=name, metric="step time s", predicted=predicted, measured=timing.total_s, tolerance=0.15)
        )
        for phase in ("forward", "backward"):
            ops = sliced.layer_phase_ops(layer.ops, (phase,))
            closed, avals = sliced.piece(ops)
            cases.append(
                Case(
                    name=name,
                    metric=f"{phase} FLOPs",
                    predicted=sum(graph.op(n).flops for n in ops),
                    measured=piece_flops(closed, avals),
                    tolerance=0.03,
                )
            )
    return cases
