# SpecFit: two commands for a newcomer (see README.md).
#   make demo   install everything, then run the main job
#   make test   install everything, then run the test suite
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test
install:
	$(PIP) install torch==2.13.0          # the CPU build that lies on disk; a bare "torch" pulls CUDA (GBs)
	$(PIP) install -e '.[test]'

demo: install
	specfit compare-solvers --preset qwen3-30b-a3b --sizes 16,32,64 --count 50 --out results/compare_solvers

test: install
	$(PYTHON) -m pytest
