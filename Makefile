# `make test` and `make demo` work from nothing: they create .venv, install torch (the CPU build
# named by TORCH_SPEC, so pip never pulls the multi-GB CUDA wheel), then the package with its dev
# extras. The stamp file makes re-runs skip set-up that is already done.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.logitgate-installed

export TORCH_DEVICE_BACKEND_AUTOLOAD ?= 0

.PHONY: test demo doctor bench setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m logitgate demo

doctor: $(STAMP)
	$(PY) -m logitgate doctor

bench: $(STAMP)
	$(PY) -m logitgate bench --out bench-out

clean:
	rm -rf $(VENV) bench-out .pytest_cache .hypothesis
