"""Group an op-graph's ops into layers, the unit the planner places."""

from orchestrator.coarsen._group import coarsen
from orchestrator.coarsen._layers import Layer, LayerGraph

__all__ = ["Layer", "LayerGraph", "coarsen"]
