"""Heterogeneous clusters: device types, hosts, and the links between them.

>>> from orchestrator.cluster import load_cluster
>>> cluster = load_cluster("mixed-a100-v100")
>>> cluster.counts_by_type()
{'a100': 16, 'v100': 16}
"""

from orchestrator.cluster._load import ClusterError, cluster_to_dict, load_cluster, parse_cluster, preset_names
from orchestrator.cluster._model import LEVELS, Cluster, Device, DeviceType, Host, Level, Link
from orchestrator.cluster._ring import ring_crossings, ring_order

__all__ = [
    "LEVELS",
    "Cluster",
    "ClusterError",
    "Device",
    "DeviceType",
    "Host",
    "Level",
    "Link",
    "cluster_to_dict",
    "load_cluster",
    "parse_cluster",
    "preset_names",
    "ring_crossings",
    "ring_order",
]
