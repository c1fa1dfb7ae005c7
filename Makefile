# Two entry points: `make demo` and `make test`. Both create .venv if missing
# and install the project with every extra (the torch extra is ~7 GB).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[torch,dev]"
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/orchestrator demo --out demo-out

# ruff, then the import contracts in pyproject.toml ([tool.importlinter]): imports run one way, from the op graph up to the CLI
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo

# two workers, one per core of the CI machine; a test file stays on one worker so its
# module fixtures (compiled steps, trained references) are built once
test: lint
	$(BIN)/python -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV)
