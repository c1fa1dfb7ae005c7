"""The H100 efficiency fit: blocks with either attention, heads, and the fused attention kernels."""

from orchestrator.bench._gpu_efficiency import fit_report, gpu_efficiency
from orchestrator.costs import Efficiency


def test_the_fit_reports_every_measured_piece_and_kernel():
    rows = fit_report()
    blocks = {row["attention"] for row in rows if row["piece"] == "block"}
    assert blocks == {"xla", "flash"}
    kernels = [row for row in rows if row["piece"] == "attention"]
    assert {row["causal"] for row in kernels} == {True, False}
    assert all(row["modelled_s"] > 0 and row["measured_s"] > 0 for row in rows)


def test_the_fused_attention_kernels_have_their_own_efficiency():
    """cuDNN's fused attention reaches less of the peak than the GEMMs around it; fitted to its
    measured forward+backward times, the kernels come within 15% and the wide flash-attention
    blocks (hidden 12288) within 10%."""
    eff = gpu_efficiency()
    assert eff.attention is not None and eff.attention < eff.matmul
    rows = fit_report()
    kernels = [row for row in rows if row["piece"] == "attention"]
    assert kernels and max(abs(row["error"]) for row in kernels) < 0.15
    wide = [row for row in rows if row["piece"] == "block" and row["attention"] == "flash" and row["hidden"] >= 6144]
    assert wide and max(abs(row["error"]) for row in wide) < 0.1


def test_an_unmeasured_attention_efficiency_is_the_matmul_one():
    eff = Efficiency(matmul=0.5)
    assert eff.attention is None and eff.of("attention") == 0.5
    assert Efficiency(matmul=0.5, attention=0.25).of("attention") == 0.25
