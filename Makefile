# Two commands on a fresh machine: `make run` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# On a box that already has a CUDA torch, reuse it (system site packages) instead of installing another.
HAVE_TORCH := $(shell $(PY) -c "import torch" >/dev/null 2>&1 && echo yes)

.PHONY: setup run test lint lab sft clean

setup: $(STAMP)

$(STAMP): pyproject.toml
ifeq ($(HAVE_TORCH),yes)
	$(PY) -m venv --system-site-packages $(VENV)
else
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --no-compile torch==2.13.0
endif
	$(VPY) -m pip install -q --no-compile -e ".[notebook,dev,data,megatron]"
	@# bytecode for every installed module, once, on all cores: where PYTHONDONTWRITEBYTECODE is set (CI boxes)
	@# nothing caches it otherwise, and each new process (test subprocesses, notebook kernels, workers) spent
	@# ~8 s recompiling torch and transformers on import. Some packages ship files that are not meant to
	@# compile (templates, py2 fixtures), so compileall's exit status is not a failure.
	-$(VPY) -m compileall -q -j 0 $$($(VPY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") >/dev/null
	touch $(STAMP)

run: $(STAMP)
	$(VPY) -m rlbench.cli demo

test: $(STAMP)
	$(VPY) -m ruff check rlbench tests benchmarks tools
	$(VPY) -m pytest -q -m "not gpu and not browser and not interpreted" --reverse-order tests
	@# The notebooks run once: in JupyterLab (the browser test: Run All as shipped, no error output, every control,
	@# a reload) where chromium is, else under nbval, which checks the same cells for errors and nothing more.
	@if [ -x "$${PLAYWRIGHT_CHROMIUM_EXECUTABLE:-$$(command -v chromium || echo /usr/bin/chromium)}" ]; then \
	  $(VPY) -m pytest -q -rs -m browser tests/test_browser.py; \
	else \
	  $(VPY) -m pytest -q --nbval-lax notebooks && \
	  echo '*** make test: the BROWSER TEST DID NOT RUN (no chromium): apt-get install -y chromium, as .ci/run does ***'; \
	fi

lint: $(STAMP)
	$(VPY) -m ruff check rlbench tests benchmarks tools

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf $(VENV) runs .pytest_cache
