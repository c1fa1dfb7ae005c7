"""``orchestrator bench torch``: checks built from a bench result, usage errors.

The full command trains for minutes; its torch_xla work is tested through
``_xla_worker`` in ``test_apply.py``. Here: the pass/fail logic and the CLI's
own errors.
"""

from typer.testing import CliRunner

from orchestrator.cli._app import app
from orchestrator.cli._torch import checks


def _config(name, predicted, all_reduce, loss_err=1e-7, param_err=1e-6, zero=False):
    return {
        "name": name,
        "losses": [5.0, 4.9],
        "reference_losses": [5.0, 4.9],
        "loss_rel_err": loss_err,
        "param_rel_err_global": param_err,
        "zero": zero,
        "predicted_all_reduce_bytes": predicted,
        "hlo_collective_bytes": {"all-reduce": all_reduce, "all-gather": 0, "reduce-scatter": 0},
    }


def test_checks_pass_and_fail_by_tolerance():
    result = {
        "configs": [
            _config("tiny TP", 1000.0, 1000),
            _config("tiny DP", 1000.0, 1200),
            _config("tiny DP2", 1000.0, 1000, loss_err=2e-5),
            _config("tiny ZeRO", 1000.0, 5000, zero=True),
        ]
    }
    rows = {(r["case"], r["metric"]): r["ok"] for r in checks(result)}
    assert rows[("TP", "all-reduce bytes")] is True
    assert rows[("DP", "all-reduce bytes")] is False
    assert rows[("DP2", "loss rel. err")] is False
    assert rows[("DP2", "param rel. L2 err")] is True
    assert [ok for (case, _), ok in rows.items() if case == "ZeRO" and ok is None]  # collectives: info only


def test_usage_error_is_one_line_exit_2():
    result = CliRunner().invoke(app, ["bench", "torch", "--batch", "6"])
    assert result.exit_code == 2
    assert "--batch 6 must divide by 4" in result.output
    assert "Traceback" not in result.output
