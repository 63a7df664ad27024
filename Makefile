# The two fresh-machine commands: `make dev` and `make test`. Both build the
# virtualenv first (and rebuild it when setup.cfg changes).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: dev test tier1 tier3 clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test,torch]'
	touch $(STAMP)

dev: $(STAMP)
	$(VENV)/bin/shardgrid dev $(DEV_ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

tier1: $(STAMP)
	$(VENV)/bin/pytest -q tests/tier1

tier3: $(STAMP)
	$(VENV)/bin/pytest -q tests/tier3

clean:
	rm -rf $(VENV) data/dev
