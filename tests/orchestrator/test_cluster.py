import copy

import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cluster import ClusterError, load_cluster, parse_cluster, preset_names

GOOD = {
    "name": "two-hosts",
    "device_types": {
        "a100": {"peak_tflops": {"float32": 19.5}, "memory_bytes": 80 * 2**30, "memory_bandwidth_gbps": 2039}
    },
    "hosts": [
        {
            "name": "h0",
            "device_type": "a100",
            "count": 4,
            "rack": "r0",
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        },
        {
            "name": "h1",
            "device_type": "a100",
            "count": 4,
            "rack": "r1",
            "intra_link": {"bandwidth_gbps": 300, "latency_us": 2},
        },
    ],
    "network": {"rack": {"bandwidth_gbps": 25, "latency_us": 5}, "cluster": {"bandwidth_gbps": 12.5, "latency_us": 15}},
}


def _with(edit):
    data = copy.deepcopy(GOOD)
    edit(data)
    return data


def test_presets_load_with_their_device_counts():
    expected = {
        "a100x8": {"a100": 8},
        "h100x16": {"h100": 16},
        "mixed-a100-v100": {"a100": 16, "v100": 16},
        "mixed-4type-64": {"h100": 16, "a100": 16, "v100": 16, "l4": 16},
        "mixed-4type-512": {"h100": 128, "a100": 128, "v100": 128, "l4": 128},
        "tpu-v4-16": {"tpu-v4": 16},
        "dgx-a100-1024": {"a100": 1024},
        "dgx-a100-3072": {"a100": 3072},
    }
    assert set(expected) | {"local"} == set(preset_names())
    for name, counts in expected.items():
        assert load_cluster(name).counts_by_type() == counts


def test_local_cluster_comes_from_jax_devices():
    import jax

    cluster = load_cluster("local")
    assert len(cluster.devices()) == len(jax.devices()) == 8
    assert cluster.shared_cores is not None  # virtual CPU devices share the machine's cores
    [dtype] = cluster.device_types.values()
    assert dtype.peak("float32") > 1e8


def test_link_levels_follow_the_hierarchy():
    cluster = load_cluster("mixed-a100-v100")
    d = cluster.devices()
    assert cluster.level(d[0], d[1]) == "host"
    assert cluster.level(d[0], d[8]) == "rack"
    assert cluster.level(d[0], d[16]) == "cluster"
    assert cluster.link(d[0], d[1]).bandwidth_bytes_per_s == 300e9
    assert cluster.link(d[0], d[8]).bandwidth_bytes_per_s == 25e9
    assert cluster.link(d[0], d[16]).bandwidth_bytes_per_s == 12.5e9
    assert cluster.slowest_link(d[:16]).bandwidth_bytes_per_s == 25e9
    assert cluster.link(d[0], d[16]).time_s(12.5e9) == pytest.approx(1.0 + 15e-6)


def test_overrides_and_unavailable_devices():
    data = _with(
        lambda d: (
            d["network"].update(overrides=[{"between": ["h0", "h1"], "bandwidth_gbps": 50, "latency_us": 1}]),
            d.update(unavailable=["h1/3"]),
        )
    )
    cluster = parse_cluster(data)
    devices = cluster.devices()
    assert len(devices) == 7
    assert cluster.link(devices[0], devices[4]).bandwidth_bytes_per_s == 50e9


BAD = {
    "missing hosts": (lambda d: d.pop("hosts"), "hosts: required field is missing"),
    "missing memory": (
        lambda d: d["device_types"]["a100"].pop("memory_bytes"),
        "device_types.a100.memory_bytes: required",
    ),
    "negative bandwidth": (
        lambda d: d["network"]["rack"].update(bandwidth_gbps=-25),
        "network.rack.bandwidth_gbps: Input should be greater than 0",
    ),
    "zero devices": (lambda d: d["hosts"][1].update(count=0), "hosts[1].count: Input should be greater than 0"),
    "zero cache": (
        lambda d: d["device_types"]["a100"].update(cache_bytes=0),
        "device_types.a100.cache_bytes: Input should be greater than 0",
    ),
    "unknown device type": (
        lambda d: d["hosts"][0].update(device_type="b200"),
        "hosts[0].device_type: unknown device type 'b200'",
    ),
    "unit-less bandwidth": (
        lambda d: d["hosts"][0]["intra_link"].update(bandwidth=300),
        "hosts[0].intra_link.bandwidth: unknown field (units belong in field names",
    ),
    "units in the value": (
        lambda d: d["network"]["cluster"].update(bandwidth_gbps="100 Gb/s"),
        "network.cluster.bandwidth_gbps: Input should be a valid number",
    ),
    "negative latency": (lambda d: d["network"]["cluster"].update(latency_us=-1), "network.cluster.latency_us"),
    "zero peak": (
        lambda d: d["device_types"]["a100"]["peak_tflops"].update(float32=0),
        "device_types.a100.peak_tflops",
    ),
    "unknown dtype": (lambda d: d["device_types"]["a100"]["peak_tflops"].update(fp32=19.5), "unknown dtype 'fp32'"),
    "duplicate host": (lambda d: d["hosts"][1].update(name="h0"), "hosts[1].name: duplicate host name 'h0'"),
    "bad unavailable ref": (lambda d: d.update(unavailable=["h0/9"]), "unavailable[0]: 'h0/9' is not a device"),
    "all unavailable": (
        lambda d: d.update(unavailable=[f"h{h}/{i}" for h in range(2) for i in range(4)]),
        "every device is unavailable",
    ),
    "override to nowhere": (
        lambda d: d["network"].update(overrides=[{"between": ["h0", "h7"], "bandwidth_gbps": 1, "latency_us": 1}]),
        "network.overrides[0].between[1]: no host or rack named 'h7'",
    ),
    "no inter-rack link": (lambda d: d["network"].pop("cluster"), "network.cluster: required"),
    "no device types": (lambda d: d.update(device_types={}), "device_types: Dictionary should have at least 1 item"),
    "infinite bandwidth": (
        lambda d: d["hosts"][0]["intra_link"].update(bandwidth_gbps=float("inf")),
        "hosts[0].intra_link.bandwidth_gbps: Input should be a finite number",
    ),
    "nan latency": (
        lambda d: d["network"]["rack"].update(latency_us=float("nan")),
        "network.rack.latency_us: Input should be a finite number",
    ),
    "infinite peak": (
        lambda d: d["device_types"]["a100"]["peak_tflops"].update(float32=float("inf")),
        "device_types.a100.peak_tflops.float32: Input should be a finite number",
    ),
    "only an int8 peak": (
        lambda d: d["device_types"]["a100"].update(peak_tflops={"int8": 624}),
        "device_types.a100.peak_tflops: Value error, needs a floating-point peak",
    ),
    "absurd device count": (
        lambda d: d["hosts"][0].update(count=10**30),
        "hosts[0].count: Input should be less than or equal to 128",
    ),
    "ten million devices on a host": (
        lambda d: d["hosts"][0].update(count=10_000_000),
        "hosts[0].count: Input should be less than or equal to 128",
    ),
    "too many devices in all": (
        lambda d: d.update(hosts=[{**d["hosts"][0], "name": f"h{i}", "count": 128} for i in range(513)]),
        "hosts: 65664 devices in all; the largest cluster accepted has 65536",
    ),
    "absurd memory": (
        lambda d: d["device_types"]["a100"].update(memory_bytes=10**30),
        "device_types.a100.memory_bytes: Input should be less than or equal to 1125899906842624",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cluster_files_fail_with_one_line_naming_the_field(case, tmp_path):
    edit, expected = BAD[case]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(edit)))
    with pytest.raises(ClusterError) as info:
        load_cluster(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert expected in message
    result = CliRunner().invoke(app, ["cluster", "show", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {message}"


def test_not_yaml_and_not_a_mapping(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ClusterError, match="not valid YAML at line"):
        load_cluster(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ClusterError, match="expected a mapping"):
        load_cluster(scalar)
    with pytest.raises(ClusterError, match="no such file"):
        load_cluster(tmp_path / "missing.yaml")
    with pytest.raises(ClusterError, match="unknown cluster preset 'a100x9'"):
        load_cluster("a100x9")


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p.write_bytes(b"name: x\xff\xfe\n"), "is not UTF-8 text (byte 7); expected a cluster YAML file"),
        (lambda p: p.mkdir(), "is a directory; expected a cluster YAML file"),
    ],
    ids=["non-UTF-8 bytes", "a directory"],
)
def test_unreadable_cluster_files_are_one_line(tmp_path, make, expected):
    path = tmp_path / "c.yaml"
    make(path)
    result = CliRunner().invoke(app, ["cluster", "show", str(path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {path} {expected}"


def test_cluster_show_prints_the_preset():
    result = CliRunner().invoke(app, ["cluster", "show", "mixed-a100-v100"])
    assert result.exit_code == 0, result.output
    assert "v100-1" in result.stdout and "rack-a" in result.stdout
    assert "32 devices in service" in result.stdout


def test_cluster_list_names_every_preset_with_its_devices():
    import json

    table = CliRunner().invoke(app, ["cluster", "list"])
    assert table.exit_code == 0, table.output
    for name in preset_names():
        assert name in table.stdout
    listed = CliRunner().invoke(app, ["cluster", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == set(preset_names())
    assert rows["mixed-a100-v100"]["devices"] == 32
    assert rows["mixed-a100-v100"]["device_types"] == {"a100": 16, "v100": 16}


def test_local_cluster_shares_the_cores_this_process_may_use(tmp_path):
    # restricted to one core (as taskset or a container's CPU set would), the 8 virtual devices share one
    import os
    import subprocess
    import sys

    script = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from orchestrator.cluster import load_cluster; print(load_cluster('local').shared_cores)"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
    assert load_cluster("local").shared_cores == len(os.sched_getaffinity(0))


def test_alias_bombs_and_deep_nesting_are_refused_in_one_line(tmp_path):
    bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    bomb += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    (tmp_path / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    with pytest.raises(ClusterError, match="more than 1000000 values once YAML aliases are expanded"):
        load_cluster(tmp_path / "bomb.yaml")
    (tmp_path / "deep.yaml").write_text("[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ClusterError, match="nested too deeply"):
        load_cluster(tmp_path / "deep.yaml")
