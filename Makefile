# Every target that needs Python depends on `install`, so on a fresh clone `make train` or
# `make test` alone sets everything up first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
NPROC  ?= 2
ROUNDS ?= 7  # make bench: paired rounds (7: every variant once in every slot)
EPOCHS ?= 6  # make bench: epochs of every program
TEST_WORKERS ?= 3  # pytest-xdist workers for make test (0: one process, serially); 3 on 2 cores: the runs wait on each other

.DEFAULT_GOAL := help
.PHONY: help install train test test-fast test-hosts lint shares bench clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv/ and install the package editable with its dev extras

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,slurm,optuna,s3]'
	touch $(STAMP)

train: install ## Default job: small_cnn on digits, 2 ranks (NPROC=2) on CPU, gloo, W&B offline
	$(PY) train.py dist.nproc=$(NPROC)

test: install ## Run the whole test suite but the host tests (W&B offline)
	WANDB_MODE=offline $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 -m "not hosts"

test-hosts: install ## The multi-host tests: 2 hosts made of network namespaces (needs root)
	WANDB_MODE=offline $(PY) -m pytest -m hosts --durations=5 tests/test_hosts.py tests/optional/live/test_live_hosts.py

test-fast: install ## Only the fast tests (no slow end-to-end runs)
	WANDB_MODE=offline $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not hosts"

lint: install ## ruff check and format, mypy (pyproject's [tool.mypy]), the docs' links and commands
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) scripts/check_docs.py

bench: $(BENCH_STAMP) ## The template against bare DDP, Lightning and accelerate (benchmarks/peers.py; ROUNDS=7 EPOCHS=6)
	WANDB_MODE=offline $(PY) benchmarks/peers.py --rounds $(ROUNDS) --epochs $(EPOCHS) --nproc $(NPROC)

$(BENCH_STAMP): $(STAMP)  # the bench extra: lightning and accelerate, for make bench only
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

shares: install ## Draw the 11-samples-on-2-ranks picture for each sampler mode (docs/shares.png)
	$(PY) -m ddp_template.sinks.share_plot --out docs/shares.png

clean: ## Remove run outputs and caches (keeps .venv/)
	rm -rf outputs multirun .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -not -path './.venv/*' -prune -exec rm -rf {} +
