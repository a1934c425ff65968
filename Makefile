# SpecFit: two commands for a newcomer (see README.md).
#   make demo   install everything, then run the main job
#   make test   install everything, then run the test suite
# PYTHON may be an unactivated venv's interpreter: make demo PYTHON=.venv/bin/python
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test
install:
	$(PIP) install torch==2.13.0          # the CPU build that lies on disk; a bare "torch" pulls CUDA (GBs)
	$(PIP) install -e '.[test]'

demo: install
	$(PYTHON) -m specfit eval

test: install
	$(PYTHON) -m pytest
