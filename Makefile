# The two commands: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m node.demo $(DEMO_ARGS)

# two workers (pytest-xdist), each taking a whole module at a time, the slow ones first
# (tests/conftest.py); TEST_WORKERS= runs the suite in one process
TEST_WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(BIN)/python -m pytest $(TEST_WORKERS) $(PYTEST_ARGS)

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench.codecs

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
