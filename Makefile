# Two commands do all set-up: `make run` and `make test`. Both create .venv if missing and install
# everything from this repo's files (idempotent: a stamp file records what was installed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvguard-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test install tools clean

run: $(STAMP)
	$(VENV)/bin/kvguard run

test: $(STAMP) tools
	$(PY) -m pytest -q

install: $(STAMP)

$(STAMP): requirements.txt requirements-ray.txt src/kvguard/assets.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -r requirements-ray.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m kvguard install-assets -- -q
	touch $(STAMP)

# Debian's chromium and prometheus for the page checks (the tests skip, saying why, without them). Idempotent:
# nothing happens where both are installed, or where apt-get is not usable (not root, no apt).
TOOLS := chromium prometheus
tools:
	@if command -v chromium >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(TOOLS) >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && \
	       DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(TOOLS) >/dev/null 2>&1; } \
	  || echo "make: apt-get could not install $(TOOLS): the browser and Prometheus checks will be skipped"; \
	else echo "make: $(TOOLS) not installed and apt-get is not usable here: those checks will be skipped"; fi

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
