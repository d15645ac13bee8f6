# Everything a fresh machine needs is set up by these targets; see README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-frameworks test-harnesses lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tvcache demo

lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

# Python caches bytecode for every process of the suite (its pytest workers, and the CLIs, servers and Ray workers
# the tests start), as it does by default: an environment that sets PYTHONDONTWRITEBYTECODE makes each of them
# compile the sources again, and pytest rewrite the assertions of its plugins (~6 s a process).
unexport PYTHONDONTWRITEBYTECODE

# The default suite in four worker processes (pytest-xdist; each with its own sandboxes and temporary
# directories): most tests wait on shells, servers and subprocesses, so four beat two even on 2 cores. Then,
# one at a time, the tests that race a process on purpose or whose reference answers by timing (marked serial).
# PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 4
test: lint
	$(PY) -m pytest -q -m 'not slow and not serial' -n $(PYTEST_WORKERS) --dist loadgroup
	$(PY) -m pytest -q -m 'serial and not slow'

# CRIU >= 4.2 for the persistent shell's process snapshots (tests/test_criu.py skips, saying so, without it): a
# minimal trixie root with forky's criu under /var/cache/tvcache/criu; ~75 s the first time, then a no-op. Root.
.PHONY: criu
criu:
	scripts/install-criu.sh

# veRL, Tinker and TRL pull in torch (~1.5-1.9 GB each, and conflicting transformers pins): each gets its own venv
# with the CPU torch wheel, and runs only its adapter's tests. CI runs this after `make test`.
FRAMEWORKS ?= verl tinker trl
test-frameworks: test-harnesses
	@for fw in $(FRAMEWORKS); do \
	  venv=.venv-$$fw; \
	  if [ ! -f $$venv/.installed ]; then \
	    $(PYTHON) -m venv $$venv && \
	    $$venv/bin/python -m pip install --quiet --upgrade pip && \
	    $$venv/bin/python -m pip install --quiet torch==2.13.0 && \
	    $$venv/bin/python -m pip install --quiet -e ".[$$fw,server]" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" && \
	    touch $$venv/.installed || exit 1; \
	  fi; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_$$fw.py \
	    tests/integrations/test_readme_snippets.py -k "$$fw" || exit 1; \
	done

# Harbor needs Python >= 3.12 (pyenv's, where the system's is older) and mini-swe-agent pulls litellm and datasets
# (~450 MB), verifiers pulls the openai and MCP SDKs (~580 MB; its v0 stack is 0.3.1's, the verifiers-v0 extra):
# each gets its own venv (no torch) and runs its adapter's tests. swe-rex is in `dev`.
PYTHON312 ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
# The OpenHands SDK needs Python >= 3.12. nemo-gym 0.7 declares Python >= 3.13.14, newer than any Python this
# machine has (pyenv's 3.13.0, Debian's 3.11; python.org is out of reach): it is installed on 3.13.0 with pip's
# --ignore-requires-python, and tests/integrations/test_nemo_gym.py runs its real servers and agent there.
PYTHON313 ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13)),python3.13)
HARNESSES ?= harbor mini-swe-agent verifiers verifiers-v0 openhands nemo-gym
test-harnesses:
	@for extra in $(HARNESSES); do \
	  venv=.venv-$$extra; module=$$(echo $$extra | tr - _); python=$(PYTHON); \
	  pipflags=; case $$extra in harbor|openhands) python=$(PYTHON312);; \
	    nemo-gym) python=$(PYTHON313); pipflags=--ignore-requires-python;; esac; \
	  if [ ! -f $$venv/.installed ]; then \
	    $$python -m venv $$venv && \
	    $$venv/bin/python -m pip install --quiet --upgrade pip && \
	    $$venv/bin/python -m pip install --quiet $$pipflags -e ".[$$extra]" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" && \
	    touch $$venv/.installed || exit 1; \
	  fi; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_$$module.py \
	    tests/integrations/test_readme_snippets.py -k "$$module" || exit 1; \
	done

format: $(STAMP)
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

bench: $(STAMP)
	$(VENV)/bin/tvcache bench lookup

clean:
	rm -rf $(VENV) .venv-verl .venv-tinker .venv-trl .venv-harbor .venv-mini-swe-agent .venv-verifiers .venv-verifiers-v0 .venv-openhands .venv-nemo-gym .pytest_cache .mypy_cache .ruff_cache
