# The two commands of the README, and the environment they share.
#   make demo   generate a small demo checkpoint, serve it, drive it, print stats
#   make test   the whole test suite (what CI runs)
#   make test-systemd   the service under a real systemd: a Debian booted with
#               systemd-nspawn, set up as deploy/README.md says (root; CI runs it)
# The virtual environment lives outside the checkout, keyed by the dependency
# spec, so a second run reuses it and a changed pyproject.toml builds a new one.
PYTHON ?= python3
CACHE_DIR ?= $(HOME)/.cache/pleserver
SPEC_HASH := $(shell $(PYTHON) -c 'import tomllib,json,hashlib;p=tomllib.load(open("pyproject.toml","rb"))["project"];print(hashlib.sha256(json.dumps([p["dependencies"],p["optional-dependencies"]],sort_keys=True).encode()).hexdigest()[:16])')
VENV ?= $(CACHE_DIR)/venv-$(SPEC_HASH)
PY := $(VENV)/bin/python

.PHONY: demo test test-systemd venv venv-core

$(VENV)/.core:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.full: $(VENV)/.core
	$(PY) -m pip install -q -e '.[test,vllm]'
	touch $@

venv-core: $(VENV)/.core
venv: $(VENV)/.full

demo: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	$(VENV)/bin/pleserver demo

test: $(VENV)/.full
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pytest $(PYTEST_ARGS)

test-systemd: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pytest -m real_systemd tests/test_ops_real_systemd.py $(PYTEST_ARGS)
