# SpecFit: two commands for a newcomer (see README.md).
#   make demo   install everything, then run the main job (a small cache-size sweep)
#   make test   install everything, then run the test suite
# PYTHON may be an unactivated venv's interpreter: make demo PYTHON=.venv/bin/python
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test
install:
	$(PIP) install torch==2.13.0          # the CPU build that lies on disk; a bare "torch" pulls CUDA (GBs)
	$(PIP) install -e '.[test]'

# the main job: where does speculation pay? ar, ar+lookahead, eagle3 and specfit (expert caches evicting by the draft's lookahead)
# over expert-cache sizes from 16 slots to all
DEMO := eval --cache-slots 16,64,all --methods ar,ar+lookahead,eagle3,specfit --eviction lookahead --limit 3 --max-new-tokens 32 --out runs/demo

demo: install
	$(PYTHON) -m specfit $(DEMO)

test: install
	$(PYTHON) -m pytest
