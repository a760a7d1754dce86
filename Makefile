# flowrl: `make demo` trains DGPO (the trainers comparison's winner) on the embedded shapes model; `make test` runs the test suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The torch build installed into a fresh venv when it has none. This machine (CPU CI) takes the
# 2.14.1 wheels from local disk; on a GPU machine install the build matching your CUDA first,
# or override, e.g. `make test TORCH_SPEC="torch torchvision --index-url https://download.pytorch.org/whl/cu124"`.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP := $(VENV)/.flowrl-installed
# Debian's browser and its WebDriver, for the demo's browser test (tests/demo/test_screenshot.py, Selenium).
BROWSER_PACKAGES := chromium chromium-driver

.PHONY: install browser test test-fast lint demo bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch, torchvision" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev,ocr]"
	@touch $@

# Installs the browser packages when `chromium` or `chromedriver` is missing (apt-get; sudo unless root).
# Without apt-get or the rights to use it, it says what to install and the browser test will fail.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  echo "make: installing $(BROWSER_PACKAGES) for the demo's browser test"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  if command -v apt-get >/dev/null 2>&1 && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
	     && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BROWSER_PACKAGES) >/dev/null; then \
	    echo "make: installed $$(chromium --version 2>/dev/null | head -1)"; \
	  else \
	    echo "make: could not install $(BROWSER_PACKAGES); install Chromium and its chromedriver (same version) or set FLOWRL_CHROMIUM / FLOWRL_CHROMEDRIVER, else tests/demo/test_screenshot.py fails"; \
	  fi; \
	fi

install: $(STAMP) browser

# The suite on both cores (pytest-xdist, one thread per worker), slowest tests listed, after the linter. Two pytest
# runs: the fake-accelerator tier (tests marked `device`, docs/gpu.md) in its own workers, since its device cannot
# follow CPU backward passes in a process that ran CPU training.
XDIST ?= -n 2
PYTEST := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST)
test: $(STAMP) browser lint
	$(PYTEST) -m "not device" --durations=25
	$(PYTEST) -m device --durations=10

lint: $(STAMP)
	$(BIN)/ruff check .

# The inner loop (about 2 minutes on 2 cores): every test not marked slow or device.
test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not device"

demo: $(STAMP)
	$(BIN)/flowrl train configs/shapes/demo.yaml

bench: $(STAMP)
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
