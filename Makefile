# flowrl: `make demo` trains Flow-GRPO on the embedded shapes model; `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch build installed into a fresh venv when it has none. This machine (CPU CI) takes the
# 2.14.1 wheels from local disk; on a GPU machine install the build matching your CUDA first,
# or override, e.g. `make test TORCH_SPEC="torch torchvision --index-url https://download.pytorch.org/whl/cu124"`.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.flowrl-installed

.PHONY: install test demo bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch, torchvision" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev,ocr]"
	@touch $@

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/flowrl train configs/shapes/flow_grpo.yaml

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
