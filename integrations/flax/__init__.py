"""JAX/Flax integration: capture a training step into Orchestrator's op-graph."""

from integrations.flax._capture import CaptureWarning, capture, is_param_path, param_logical_axes, parse_name_stack
from integrations.flax._nnx import from_nnx
from integrations.flax._observe import Dispatch, PipelineObserver
from integrations.flax._orchestrate import OrchestratedTrainState, orchestrate
from integrations.flax._pipeline import Pipeline, cut_stages
from integrations.flax._profile import LayerProfiler, profile_layers
from integrations.flax._run import DevicesLost, LoseDevices, RunConfig, RunResult, latest_checkpoint, train
from integrations.flax._shard import shard, stage_mesh, state_shardings
from integrations.flax._slice import SlicedStep, piece_flops
from integrations.flax._step import compile_step
from integrations.flax._xla import XlaFlops, XlaProgram, hlo_collective_bytes, xla_flops, xla_program

__all__ = [
    "CaptureWarning",
    "DevicesLost",
    "Dispatch",
    "LayerProfiler",
    "LoseDevices",
    "OrchestratedTrainState",
    "Pipeline",
    "PipelineObserver",
    "RunConfig",
    "RunResult",
    "SlicedStep",
    "XlaFlops",
    "XlaProgram",
    "capture",
    "compile_step",
    "cut_stages",
    "from_nnx",
    "hlo_collective_bytes",
    "is_param_path",
    "latest_checkpoint",
    "orchestrate",
    "param_logical_axes",
    "parse_name_stack",
    "piece_flops",
    "profile_layers",
    "shard",
    "stage_mesh",
    "state_shardings",
    "train",
    "xla_flops",
    "xla_program",
]
