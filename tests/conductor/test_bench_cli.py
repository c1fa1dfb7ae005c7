"""``orchestrator bench conductor --quick --json``: cases with name, ok and figures; the kernels lower for TPU and CUDA."""

import json

from typer.testing import CliRunner

from orchestrator.cli import app


def test_bench_conductor_quick_json():
    result = CliRunner().invoke(app, ["bench", "conductor", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    cases = {c["name"]: c for c in json.loads(result.stdout)["cases"]}
    assert all({"name", "ok"} <= set(c) for c in cases.values())
    for name in ("export_attention_tpu", "export_attention_cuda", "export_scan_tpu", "export_scan_cuda"):
        assert cases[name]["ok"], cases[name]
    assert cases["export_attention_tpu"]["custom_calls"] == ["tpu_custom_call"]
    assert cases["export_scan_cuda"]["custom_calls"] == ["triton"]
    memory = cases["attention_memory_growth"]
    assert memory["rewritten_growth"] < memory["naive_growth"]
    assert cases["scan_memory"]["rewritten_temp_bytes"] < cases["scan_memory"]["written_temp_bytes"]
    spellings = [c for name, c in cases.items() if name.startswith("attention_spelling_memory_")]
    assert len(spellings) == 4  # fp32 and bf16, MHA and GQA
    for case in spellings:  # found, rewritten by default, and smaller already at T=1024
        assert case["rewritten_by_default"] and case["rewritten_temp_bytes"] < case["written_temp_bytes"], case
    rings = {name: c for name, c in cases.items() if name.startswith("ring_")}
    assert rings["ring_order_two_hosts"]["ok"] and rings["ring_order_two_hosts"]["inter_host_crossings"] == 2
    for name, case in rings.items():  # numerics, permute bytes, memory and balance at T=1024 on rings of 2 and 4
        assert case["ok"], (name, case)
    assert {"ring_numerics_cp4_T1024_causal_gqa", "ring_permute_bytes_cp4_T1024", "ring_balance_cp4_T1024"} <= set(
        rings
    )
