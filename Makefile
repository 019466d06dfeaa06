# Quick start: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_STEPS ?= 200

.PHONY: demo test typecheck install dev bench conformance clean

$(VENV)/.installed: pyproject.toml scripts/install_torch.sh
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed pyproject.toml
	DS_BUILD_OPS=0 $(PIP) install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

demo: $(VENV)/.installed
	$(VENV)/bin/shardwise train --nproc 2 --model tiny --data stdlib --steps $(DEMO_STEPS) --eval-every 50 \
		--save-every $(DEMO_STEPS) --out runs/demo

# mypy over shardwise/ (configured in pyproject.toml; strict on the engine's interfaces), before the tests.
typecheck: $(VENV)/.dev-installed
	$(PY) -m mypy

test: $(VENV)/.dev-installed typecheck
	DS_ACCELERATOR=cpu $(PY) -m pytest -q tests

bench: $(VENV)/.dev-installed
	DS_ACCELERATOR=cpu $(VENV)/bin/shardwise bench dp --nproc 2
	DS_ACCELERATOR=cpu $(VENV)/bin/shardwise bench allreduce --nproc 2

# The peers' own test suites run against shardwise (not part of `make test`: it needs their repositories).
# DEEPSPEED_SRC: a DeepSpeed checkout (its tests/); TORCH_SRC: a pytorch checkout for the installed torch (its test/).
conformance: $(VENV)/.dev-installed
	$(PY) -m benchmarks.conformance.run $(if $(DEEPSPEED_SRC),--deepspeed-src $(DEEPSPEED_SRC)) \
		$(if $(TORCH_SRC),--torch-src $(TORCH_SRC)) --out docs/conformance.md $(CONFORMANCE_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
