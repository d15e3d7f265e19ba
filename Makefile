# Two commands do all set-up: `make run` and `make test`. Both create .venv if missing and install
# everything from this repo's files (idempotent: a stamp file records what was installed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvguard-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test install clean

run: $(STAMP)
	$(VENV)/bin/kvguard run

test: $(STAMP)
	$(PY) -m pytest -q

install: $(STAMP)

$(STAMP): requirements.txt requirements-ray.txt requirements-assets.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -r requirements-ray.txt
	$(PY) -m pip install -q --no-deps -r requirements-assets.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
