# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   - create .venv if needed, install the package, run the main example
#   make test   - the same, then the test suite once per Keras flavour (each in its own process)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: demo test test-keras3 test-tf-keras test-slow bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install -q --upgrade pip 2>/dev/null || true
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/accumulate_fit.py

# Each flavour runs in its own process: tfmot and TF_USE_LEGACY_KERAS fix the
# flavour for the whole process, so the two must never share one.
test-keras3: $(STAMP)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) -m "not slow"

test-tf-keras: $(STAMP)
	TF_USE_LEGACY_KERAS=1 $(PYTEST) -m "not slow"

test: test-keras3 test-tf-keras
	$(PY) examples/accumulate_fit.py
	$(PY) examples/accumulate_custom_loop.py
	$(PY) examples/lm_curve_fit.py
	$(PY) examples/lm_fit.py
	$(PY) examples/conditional_accumulator.py
	$(PY) examples/nmf.py
	$(PY) examples/constrained_classifier.py
	$(PY) examples/pruning_workflow.py

test-slow: $(STAMP)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) -m slow
	TF_USE_LEGACY_KERAS=1 $(PYTEST) -m slow

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	# The peers pin TensorFlow 2.13 and numpy<=1.23.2 in their metadata but run
	# on TF 2.21 (shared/ANCHORS.md); --no-deps keeps our environment intact.
	$(PY) -m pip install -q --no-deps gradient-accumulator tf-levenberg-marquardt
	$(PY) benchmarks/accumulation.py
	$(PY) benchmarks/lm_sinc.py
	$(PY) benchmarks/lm_memory.py
	$(PY) benchmarks/nist_table.py
	$(PY) benchmarks/constraints.py
	$(PY) benchmarks/frank_wolfe.py
	$(PY) benchmarks/pruning.py

clean:
	rm -rf $(VENV) build *.egg-info
