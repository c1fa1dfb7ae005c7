import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.graph import OP_KINDS, PHASES, Op, OpGraph, TensorSpec


def _op(name, **kw):
    return Op(name=name, kind=kw.pop("kind", "matmul"), primitive=kw.pop("primitive", "dot_general"), **kw)


def test_tensor_spec_bytes():
    assert TensorSpec(shape=(4, 8), dtype="float32").nbytes == 128
    assert TensorSpec(shape=(3,), dtype="bfloat16").nbytes == 6
    assert TensorSpec(shape=(), dtype="int32").size == 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("kind", "gemm", "kind 'gemm'"), ("phase", "fwd", "phase 'fwd'"), ("repeats", 0, "repeats")],
)
def test_op_rejects_values_outside_the_vocabulary(field, value, message):
    kwargs = {"name": "x", "kind": "matmul", "primitive": "dot_general", field: value}
    with pytest.raises(ValueError, match=message):
        Op(**kwargs)


def test_edges_accumulate_and_totals_filter():
    g = OpGraph(name="t")
    g.add_op(_op("a", flops=10.0))
    g.add_op(_op("b", kind="elementwise", primitive="add", flops=2.0, phase="backward"))
    g.add_edge("a", "b", nbytes=16)
    g.add_edge("a", "b", nbytes=8)
    assert list(g.edges()) == [("a", "b", 24)]
    assert g.total_flops() == 12.0
    assert g.total_flops(phase="backward") == 2.0
    assert g.total_flops(kind="matmul") == 10.0
    assert g.flops_by("kind") == {"matmul": 10.0, "elementwise": 2.0}
    with pytest.raises(ValueError, match="duplicate"):
        g.add_op(_op("a"))
    with pytest.raises(KeyError, match="unknown op"):
        g.add_edge("a", "zzz", nbytes=1)


def test_old_format_is_refused_with_a_fix():
    data = OpGraph(name="t").to_json()
    data["format_version"] = 0
    with pytest.raises(ValueError, match="capture the graph again"):
        OpGraph.from_json(data)


specs = st.builds(
    TensorSpec,
    shape=st.lists(st.integers(1, 64), max_size=4).map(tuple),
    dtype=st.sampled_from(["float32", "bfloat16", "int32", "bool"]),
)


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 12))
    params = {f"p{i}": draw(specs) for i in range(draw(st.integers(0, 3)))}
    g = OpGraph(name=draw(st.text(max_size=8)), params=params, meta={"k": [1, 2]})
    for i in range(n):
        g.add_op(
            Op(
                name=f"op{i}",
                kind=draw(st.sampled_from(OP_KINDS)),
                primitive=draw(st.sampled_from(["dot_general", "add", "scan"])),
                inputs=tuple(draw(st.lists(specs, max_size=3))),
                outputs=tuple(draw(st.lists(specs, min_size=1, max_size=2))),
                flops=draw(st.floats(0, 1e18)),
                param_bytes=draw(st.integers(0, 10**9)),
                scope=draw(st.sampled_from(["", "GPT/blocks_0", "GPT/wte.attend"])),
                phase=draw(st.sampled_from(PHASES)),
                repeats=draw(st.integers(1, 4096)),
            )
        )
    for _ in range(draw(st.integers(0, 2 * n))):
        a, b = sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2)))
        if a != b:
            g.add_edge(f"op{a}", f"op{b}", nbytes=draw(st.integers(0, 10**9)))
    return g


@settings(max_examples=50, deadline=None)
@given(graphs())
def test_json_round_trip(g):
    again = OpGraph.from_json(json.loads(json.dumps(g.to_json())))
    assert again == g
    assert again.is_dag()
    assert again.total_flops() == g.total_flops()


def test_save_and_load(tmp_path):
    g = OpGraph(name="t", params={"w": TensorSpec(shape=(1,), dtype="float32")})
    assert g.param_bytes == 4
    g.add_op(_op("a", inputs=(TensorSpec(shape=(2,), dtype="float32"),)))
    g.save(tmp_path / "g.json")
    assert OpGraph.load(tmp_path / "g.json") == g
