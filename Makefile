# The two commands of the README, and the environment they share.
#   make demo   generate a small demo checkpoint, serve it, drive it, print stats
#   make test   the whole test suite (what CI runs)
#   make test-systemd   the service under a real systemd: a Debian booted with
#               systemd-nspawn, set up as deploy/README.md says (root; CI runs it)
#   make native-sanitize   the native module's tests under ASan and UBSan
#   make lint   ruff (lint, and the format check) over the tree, mypy over the
#               packages (CI runs it)
#   make wheels the wheel of this machine's architecture, into WHEEL_DIR (dist),
#               installed and checked in a fresh venv (CI runs it)
#   make images the container images' builds (deploy/container/) as far as
#               their Python goes, without a container engine: each build
#               context installed by its Dockerfile's own steps (CI runs it)
#   make test-aarch64   aarch64 under qemu-user-static: an arm64 Debian, the
#               build, the native tests, the images' builds, a server and two
#               clients, the aarch64 wheel into WHEEL_DIR, the ordering in the
#               disassembly (root; CI runs it)
#   make figures        the docs' SVG figures, from the recorded results in
#               docs/figures/data/ (standard library only; tests/test_figures.py
#               checks the committed ones)
#   make man    man/pleserver.1 from the command line's parser (argparse-manpage;
#               tests/test_ops_cli.py checks that the committed page is current)
# The virtual environment lives outside the checkout, keyed by the checkout's
# path and the dependency spec: a second run reuses it, a changed
# pyproject.toml builds a new one, and two checkouts never share one (its
# editable install points at one checkout).
PYTHON ?= python3
CACHE_DIR ?= $(HOME)/.cache/pleserver
SPEC_HASH := $(shell $(PYTHON) -c 'import tomllib,json,hashlib,os;p=tomllib.load(open("pyproject.toml","rb"))["project"];print(hashlib.sha256(json.dumps([os.getcwd(),p["dependencies"],p["optional-dependencies"]],sort_keys=True).encode()).hexdigest()[:16])')
VENV ?= $(CACHE_DIR)/venv-$(SPEC_HASH)
PY := $(VENV)/bin/python
# Compiler warnings are errors in every build these targets make, and so in
# CI; a user's `pip install` from source leaves them warnings (setup.py).
export PLESERVER_WERROR ?= 1

.PHONY: demo test test-systemd venv venv-core native-sanitize lint wheels images test-aarch64

$(VENV)/.core:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The linters (the dev extra) only where lint runs: `make demo` needs neither them
# nor vLLM.
$(VENV)/.full: $(VENV)/.core
	$(PY) -m pip install -q -e '.[test,dev,vllm]'
	touch $@

venv-core: $(VENV)/.core
venv: $(VENV)/.full

demo: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	$(VENV)/bin/pleserver demo

test: $(VENV)/.full
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pytest $(PYTEST_ARGS)

# Configured in pyproject.toml. mypy reads the vllm extra's torch and vLLM types
# (the plugin patches vLLM classes), hence the full venv; the native module
# needs no build (pleserver/_native.pyi stands in for it).
lint: $(VENV)/.full
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test-systemd: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pytest -m real_systemd tests/test_ops_real_systemd.py $(PYTEST_ARGS)

# The native extension built with AddressSanitizer and UBSan in a copy of the
# tree (so the normal in-place build is left alone), then its tests run there.
# libasan is preloaded because the interpreter itself is not instrumented;
# leak detection is off because CPython keeps memory until exit by design.
SANITIZE_DIR ?= build-sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
native-sanitize: $(VENV)/.core
	rm -rf $(SANITIZE_DIR)
	mkdir -p $(SANITIZE_DIR)
	cp -r setup.py pyproject.toml MANIFEST.in README.md pleserver pleclient tests $(SANITIZE_DIR)/
	rm -f $(SANITIZE_DIR)/pleserver/_native*.so $(SANITIZE_DIR)/pleclient/_sync*.so
	# setup.py runs in the venv here, not in pip's isolated build environment,
	# so the venv needs the build requirements (a fresh venv's setuptools is older).
	$(PY) -m pip install -q $$($(PY) -c 'import tomllib;print(" ".join(tomllib.load(open("pyproject.toml","rb"))["build-system"]["requires"]))')
	cd $(SANITIZE_DIR) && CFLAGS="$(SANITIZE_FLAGS)" LDFLAGS="$(SANITIZE_FLAGS)" \
		$(PY) setup.py -q build_ext --inplace
	cd $(SANITIZE_DIR) && LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		PYTHONPATH="$$PWD" $(PY) -m pytest -p no:cacheprovider -q $(PYTEST_ARGS) tests/test_native_*.py

# The wheel a user installs without a compiler, for this machine's
# architecture: .ci/build-wheel (pip wheel on the stable ABI, auditwheel
# repair: a manylinux tag) into WHEEL_DIR; then tests/test_ops_install.py
# checks its tags and installs it into a fresh venv. test-aarch64 puts the
# aarch64 wheel beside it.
WHEEL_DIR ?= dist
wheels: $(VENV)/.core
	.ci/build-wheel $(PY) $(WHEEL_DIR)
	PLE_WHEEL_DIR=$(WHEEL_DIR) $(PY) -m pytest -p no:cacheprovider -m wheels \
		tests/test_ops_install.py $(PYTEST_ARGS)

# deploy/container/'s images, built as far as their Python goes (CI has no
# container engine, nor a registry to pull their bases from): each
# Dockerfile's COPY lines resolved against its build context (the tree through
# .dockerignore), its pip and Python steps run in a fresh venv standing in for
# the base image's Python, the result run as the image runs it
# (tests/test_ops_container.py; test-aarch64 builds them on arm64 too).
images: $(VENV)/.core
	$(PY) -m pytest -p no:cacheprovider -m images tests/test_ops_container.py $(PYTEST_ARGS)

# aarch64 under qemu-user-static (root; tests/test_aarch64.py says what it needs).
test-aarch64: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	PLE_WHEEL_DIR=$(WHEEL_DIR) $(PY) -m pytest -p no:cacheprovider -rA -m aarch64 \
		tests/test_aarch64.py $(PYTEST_ARGS)

# The figures in README.md and docs/, made from the recorded results
# (docs/figures/data/README.md says where each came from). Only the standard
# library: no venv needed.
.PHONY: figures
figures:
	$(PYTHON) docs/figures/make.py

# The man page the package installs (setup.py), from the parser: run it after
# a change to any command, option or setting.
.PHONY: man
man: $(VENV)/.core
	$(PY) -m pip install -q --no-deps -e .
	$(PY) man/make.py
