# Everything a fresh machine needs is set up by these targets; see README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-frameworks lint format bench clean

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

test: lint
	$(PY) -m pytest -q -m 'not slow'

# veRL and Tinker pull in torch (~1.5-1.9 GB each, and conflicting transformers pins): each gets its own venv
# with the CPU torch wheel, and runs only its adapter's tests. CI runs this after `make test`.
FRAMEWORKS ?= verl tinker
test-frameworks:
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

format: $(STAMP)
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

bench: $(STAMP)
	$(VENV)/bin/tvcache bench lookup

clean:
	rm -rf $(VENV) .venv-verl .venv-tinker .pytest_cache .mypy_cache .ruff_cache
