"""Ring order on a cluster: hosts and racks contiguous, so the slow links are crossed the fewest times."""

import copy

import pytest

from orchestrator.cluster import load_cluster, parse_cluster, ring_crossings, ring_order

TWO_HOSTS = {
    "name": "two-hosts",
    "device_types": {
        "a100": {"peak_tflops": {"float32": 19.5}, "memory_bytes": 80 * 2**30, "memory_bandwidth_gbps": 2039}
    },
    "hosts": [
        {
            "name": f"h{i}",
            "device_type": "a100",
            "count": 4,
            "rack": "r0",
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        }
        for i in range(2)
    ],
    "network": {"rack": {"bandwidth_gbps": 25, "latency_us": 5}},
}


def test_two_host_ring_crosses_the_inter_host_link_exactly_twice():
    cluster = parse_cluster(TWO_HOSTS)
    devices = cluster.devices()
    interleaved = [d for pair in zip(devices[:4], devices[4:]) for d in pair]  # h0/0, h1/0, h0/1, ...
    assert ring_crossings(cluster, interleaved)["rack"] == 8  # what a naive order pays
    order = ring_order(cluster, interleaved)
    assert [d.ref for d in order] == [f"h{h}/{i}" for h in range(2) for i in range(4)]
    assert ring_crossings(cluster, order) == {"device": 0, "host": 6, "rack": 2, "cluster": 0}
    assert cluster.slowest_link(order).bandwidth_bytes_per_s == 25e9


def test_racks_stay_contiguous_and_overrides_pick_the_next_host():
    data = copy.deepcopy(TWO_HOSTS)
    data["hosts"] = [
        {
            "name": f"h{i}",
            "device_type": "a100",
            "count": 2,
            "rack": rack,
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        }
        for i, rack in enumerate(["r0", "r1", "r0", "r1"])
    ]
    data["network"] = {
        "rack": {"bandwidth_gbps": 25, "latency_us": 5},
        "cluster": {"bandwidth_gbps": 12.5, "latency_us": 15},
    }
    cluster = parse_cluster(data)
    order = ring_order(cluster)
    assert [d.host for d in order] == ["h0", "h0", "h2", "h2", "h1", "h1", "h3", "h3"]
    assert ring_crossings(cluster, order) == {"device": 0, "host": 4, "rack": 2, "cluster": 2}

    data["hosts"].append(
        {
            "name": "h4",
            "device_type": "a100",
            "count": 2,
            "rack": "r0",
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        }
    )
    data["network"]["overrides"] = [{"between": ["h0", "h4"], "bandwidth_gbps": 50, "latency_us": 1}]
    order = ring_order(parse_cluster(data))
    assert [d.host for d in order][:6] == ["h0", "h0", "h4", "h4", "h2", "h2"]


def test_a_preset_ring_and_bad_members():
    cluster = load_cluster("mixed-a100-v100")
    order = ring_order(cluster)
    assert sorted(d.id for d in order) == list(range(32))
    assert ring_crossings(cluster, order)["cluster"] == 2  # rack-a and rack-v joined twice
    assert ring_order(cluster, []) == []
    with pytest.raises(ValueError, match="listed twice"):
        ring_order(cluster, [order[0], order[0]])
