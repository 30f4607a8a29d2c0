# Two commands on a fresh machine: `make run` (the default job) and `make test` (the test suite).
# Both create .venv with Python 3.12 on first use; nothing else needs to be installed first.
PY312 ?= $(shell command -v python3.12 2>/dev/null || echo $(HOME)/.pyenv/versions/3.12.1/bin/python3.12)
VENV := .venv
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed

.PHONY: setup run test lint format clean lock bench-deps

$(STAMP): pyproject.toml requirements.lock
	@test -x $(VENV)/bin/python || $(PY312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --disable-pip-version-check uv
	$(UV) pip install --python $(VENV)/bin/python -r requirements.lock
	$(UV) pip install --python $(VENV)/bin/python --no-deps -e .
	# SGLang's own request/response types (sglang/api/v1/api_types.py, needs only msgspec) validate the
	# engine client; the package itself cannot run here, so its dependencies are not installed.
	$(UV) pip install --python $(VENV)/bin/python --no-deps sglang==0.5.23
	@touch $(STAMP)

bench-deps: $(STAMP)
	$(UV) pip install --python $(VENV)/bin/python "ray[default]>=2.30"


setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tidal run $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q tests $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

lock:
	$(UV) pip compile pyproject.toml --extra test --python-version 3.12 -o requirements.lock

clean:
	rm -rf $(VENV)
