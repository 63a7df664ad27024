# The two fresh-machine commands: `make dev` and `make test`. Both build the
# virtualenv first (and rebuild it when setup.cfg changes).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: dev test tier1 tier3 sim clean

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

# The shell simulator (tests/support/shell_sim.py): SEEDS=N seeds, or SEED=S
# alone with its trace; SHARDGRID_SIM_PLANT=NAME plants a known bug (it must fail).
SEEDS ?= 200
SEED ?=
sim: $(STAMP)
	SHARDGRID_SHELL_SIM_SEEDS=$(SEEDS) SHARDGRID_SHELL_SIM_SEED=$(SEED) \
		$(VENV)/bin/pytest -q -p no:cacheprovider tests/tier1/test_shell_sim.py -k test_seeds

clean:
	rm -rf $(VENV) data/dev
