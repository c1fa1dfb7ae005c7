import json

from typer.testing import CliRunner

from orchestrator.cli import app

runner = CliRunner()


def test_graph_json_has_layers_and_totals():
    result = runner.invoke(app, ["graph", "--recipe", "gpt-tiny", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [layer["name"] for layer in payload["layers"]] == [
        "GPT/wte+wpe",
        "GPT/blocks_0",
        "GPT/blocks_1",
        "GPT/ln_f+wte.attend",
    ]
    for layer in payload["layers"]:
        assert {"name", "flops", "param_bytes", "activation_bytes"} <= set(layer)
    totals = payload["totals"]
    assert abs(totals["flops"] / totals["xla_flops"] - 1) < 0.02
    assert totals["param_bytes"] == sum(layer["param_bytes"] for layer in payload["layers"])


def test_graph_table():
    result = runner.invoke(app, ["graph", "--recipe", "mamba-tiny", "--no-xla"])
    assert result.exit_code == 0, result.output
    assert "Mamba/layers_1" in result.stdout
    assert "total" in result.stdout


def test_unknown_recipe_is_one_line_and_exit_2():
    result = runner.invoke(app, ["graph", "--recipe", "gpt-5"])
    assert result.exit_code == 2
    assert "unknown recipe 'gpt-5'" in result.stderr
    assert "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


def test_too_long_sequence_is_a_clear_error():
    result = runner.invoke(app, ["graph", "--recipe", "gpt-tiny", "--seq-len", "100"])
    assert result.exit_code == 2
    assert "max_seq_len 64" in result.stderr


def test_json_on_stdout_is_pure_json_in_a_real_process():
    """The solver's C++ banner (highspy 1.16 prints one per process) reaches neither stdout nor stderr, unless
    ``--verbose`` asks for it (on stderr)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "orchestrator"
    args = ["plan", "--recipe", "gpt-tiny", "--cluster", "a100x8", "--batch", "16", "--json"]
    done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["global_batch"] == 16
    assert "Copyright" not in done.stderr
    verbose = subprocess.run([str(script), "--verbose", *args], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0, verbose.stderr
    assert json.loads(verbose.stdout)["global_batch"] == 16
    assert "HiGHS" in verbose.stderr and "Copyright" in verbose.stderr


def test_verbose_is_accepted_before_or_after_the_command():
    for args in (["--verbose", "cluster", "list"], ["cluster", "list", "--verbose"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "mixed-a100-v100" in result.stdout
