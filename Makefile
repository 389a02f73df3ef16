# `make test` and `make demo` work from nothing: they create .venv, install torch (the CPU build
# named by TORCH_SPEC, so pip never pulls the multi-GB CUDA wheel), then the package with its dev
# extras. The stamp file makes re-runs skip set-up that is already done.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.logitgate-installed

# The vLLM integration is tested against vLLM's real interface classes. vLLM's declared
# dependencies pull a CUDA torch and GPU kernels, so vllm and exactly the pure-Python packages its
# interface modules import are installed one by one with --no-deps (none of them needs torch), at
# the versions tested here. About 340 MB of downloads (30-45 s here). `make test VLLM_SPEC=` skips it.
VLLM_SPEC ?= vllm==0.33.0
VLLM_DEPS := aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 \
	attrs==26.1.0 cachetools==8.0.1 cbor2==6.2.1 certifi==2026.10.18 charset-normalizer==3.5.2 \
	cloudpickle==3.1.2 frozenlist==1.8.0 idna==3.20 msgspec==0.22.0 multidict==7.2.1 openai==3.54.0 \
	openai-harmony==0.0.8 propcache==0.5.4 psutil==7.2.2 py-cpuinfo==9.0.0 pybase64==1.5.1 \
	pydantic==2.14.3 pydantic-core==2.50.4 pyzmq==27.3.0 requests==2.34.2 sniffio==1.3.1 \
	typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 uvloop==0.23.0 yarl==1.25.1 \
	zmq==0.0.0
VLLM_STAMP := $(VENV)/.logitgate-vllm-installed

export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: test demo doctor bench setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps "$(VLLM_SPEC)" $(VLLM_DEPS)
	touch $(VLLM_STAMP)

setup: $(STAMP)

test: $(STAMP) $(if $(VLLM_SPEC),$(VLLM_STAMP))
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m logitgate demo

doctor: $(STAMP)
	$(PY) -m logitgate doctor

bench: $(STAMP)
	$(PY) -m logitgate bench --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis
