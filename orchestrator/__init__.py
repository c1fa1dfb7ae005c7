"""Orchestrator: plan and run training steps across mixed accelerator clusters.

Data flows one way: capture → op-graph (:mod:`orchestrator.graph`) → layers
(:mod:`orchestrator.coarsen`) → costs → plan → simulate | execute. Importing
this package has no side effects and never imports torch.
"""

from orchestrator.coarsen import Layer, LayerGraph, coarsen
from orchestrator.graph import Op, OpGraph, TensorSpec

__version__ = "0.1.0"

__all__ = ["Layer", "LayerGraph", "Op", "OpGraph", "TensorSpec", "__version__", "coarsen"]
