# Every target creates .venv and installs into it, so each works on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export MASTER_ADDR ?= 127.0.0.1

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: it takes the local CPU wheel; an unpinned torch would pull CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	# DeepSpeed (in the dev extra): no op pre-build, and torch pinned in the same command so it cannot be upgraded.
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e '.[dev]' torch==2.13.0
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(VENV)/bin/ruff check perdure tests examples benchmarks
	$(VENV)/bin/ruff format --check perdure tests examples benchmarks
	# What a user's program meets: mypy --strict (config in pyproject.toml), on every example. Its cache is its own:
	# tests/test_types.py reuses it (the run below, at other options, would make it recheck torch: ~100 s of CPU).
	$(VENV)/bin/mypy --strict --cache-dir .mypy_cache/strict examples/*.py
	# perdure itself, at mypy's default strictness (issue 39).
	$(VENV)/bin/mypy perdure

# Two workers: most tests wait on the processes they launch (kills, ranks, replica groups), so two keep both cores busy.
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist worksteal --durations=20 -p tests.cpu_report

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) runs bench-results
