# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   - create .venv if needed, install the package, run the main example
#   make test   - the same, then the test suite once per Keras flavour (each in its own process)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: demo test test-keras3 test-tf-keras test-keras3-local test-tf-keras-local test-gpu test-slow test-compat bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install -q --upgrade pip 2>/dev/null || true
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/accumulate_fit.py

# The test runs compile hundreds of tiny XLA programs on the CPU, where LLVM's
# optimisation of the generated code costs more than running it: at level 0
# the jit battery cells take about a third less CPU time (measured 40 s vs
# 61 s). Skipping LLVM's expensive passes took about a tenth more off the
# compiled fits' tests (test_small_fits.py's compaction tests: 41 s -> 38 s
# of CPU). XLA's older CPU emitters (no per-fusion MLIR pipeline) compile a
# least_squares solve in 1.5 s of CPU instead of 2.5 s, and took
# test_small_fits.py with test_rerun_guard.py from 151 s to 111 s of CPU.
# Exported to every test process and example these targets start (a
# user's own XLA_FLAGS are kept); `make test-gpu` keeps XLA's defaults.
XLA_OLDER_EMITTERS := --xla_cpu_use_fusion_emitters=false
XLA_TEST_FLAGS := --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true \
	$(XLA_OLDER_EMITTERS)
test test-keras3 test-tf-keras test-keras3-local test-tf-keras-local test-slow: \
  export XLA_FLAGS := $(strip $(filter-out $(XLA_TEST_FLAGS),$(XLA_FLAGS)) $(XLA_TEST_FLAGS))

# Except these files, run with XLA's default (fusion) emitters, the user's:
# they check that two lowerings of one solve (a stored StableHLO module, the
# usual compiled solve) give the same fits to the bit, which holds there;
# under the older emitters the two compile differently (measured: float32
# fits 3e-4 apart, a float64 covariance 7.7e-16 apart). And the unrolled QR's
# tests of backward stability: at optimisation level 0 with the older emitters,
# XLA's compile of `batched_parts.unrolled_qr` alone (two problems with nearly
# equal columns) gave R^T R 507 eps |J_i| |J_j| off, against 3.5 with either
# flag alone or XLA's defaults (numpy's float32 run of the same steps: 2.0).
DEFAULT_EMITTER_TESTS := tests/test_module_store.py tests/test_covariance_factor.py
DEFAULT_EMITTERS = XLA_FLAGS="$(strip $(filter-out $(XLA_OLDER_EMITTERS),$(XLA_FLAGS)))"

# Each flavour runs in its own process: tfmot and TF_USE_LEGACY_KERAS fix the
# flavour for the whole process, so the two must never share one.
test-keras3: $(STAMP)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) -m "not slow" $(addprefix --ignore=,$(DEFAULT_EMITTER_TESTS))
	$(DEFAULT_EMITTERS) TF_USE_LEGACY_KERAS=0 $(PYTEST) -m "not slow" $(DEFAULT_EMITTER_TESTS)

# Tests marked keras_free import no Keras (tf_gradkit.core, least_squares):
# they run once, in the Keras 3 process.
test-tf-keras: $(STAMP)
	TF_USE_LEGACY_KERAS=1 $(PYTEST) -m "not slow and not keras_free"

EXAMPLES := accumulate_fit \
	accumulate_custom_loop \
	accumulate_tokens \
	lm_curve_fit \
	batched_curve_fit \
	lm_fit \
	conditional_accumulator \
	nmf \
	constrained_classifier \
	pruning_workflow \
	pruning_keras3 \
	pinn_poisson \
	dp_sgd \
	gradient_tools
# These start worker processes on loopback ports: one at a time.
MULTIPROCESS_EXAMPLES := multiworker_fit parameter_server

# `make test`: the two flavours' suites side by side (two processes for the
# two cores; each process is mostly single-threaded Python on small models),
# then the multi-process tests and examples one at a time (their time bounds
# assume the cores are theirs), then the other examples two at a time.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-keras3-local test-tf-keras-local
	TF_USE_LEGACY_KERAS=0 $(PYTEST) -m "multiworker and not slow"
	TF_USE_LEGACY_KERAS=1 $(PYTEST) -m "multiworker and not slow and not keras_free"
	$(MAKE) --no-print-directory $(addprefix example-,$(MULTIPROCESS_EXAMPLES))
	$(MAKE) --no-print-directory -j2 --output-sync=target $(addprefix example-,$(EXAMPLES))

# Tests marked keras_free import no Keras, so either side of `make test` can run
# them; these files run on the tf_keras side (in a process of their own, after
# the tf_keras suite) so that the two sides take about the same time.
KERAS_FREE_BESIDE_TF_KERAS := tests/test_nist.py tests/test_lm_trust_region.py \
	tests/test_scipy_least_squares.py tests/test_least_squares_scipy.py \
	tests/test_implicit_least_squares.py \
	tests/test_batched_least_squares.py tests/test_spd.py tests/test_projections.py \
	tests/test_precision.py tests/test_scipy_curve_fit.py tests/test_gpufit_conformance.py \
	tests/test_loop_data.py

# Each side runs its files in processes one after the other (two halves; the
# Keras 3 side's first half split again, below): a process's
# heap grows with every model and traced function its tests leave behind (7 GB
# by the end of one Keras 3 process), and so does the cost of each test in it.
# The Keras 3 side's first half runs as two processes (a-e, f-k): in one, the
# garbage the docs and doctests leave behind was collected in a single pause
# of 56-107 s (Python's collector, two runs of 2026-11-29), in test_gpu_state.
TESTS_FIRST_HALF := $(sort $(wildcard tests/test_[a-k]*.py))
TESTS_A_TO_E := $(sort $(wildcard tests/test_[a-e]*.py))
TESTS_SECOND_HALF := $(filter-out $(TESTS_FIRST_HALF),$(sort $(wildcard tests/test_*.py)))

test-keras3-local: $(STAMP)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) --durations=10 -m "not slow and not multiworker" \
	  $(filter-out $(KERAS_FREE_BESIDE_TF_KERAS) $(DEFAULT_EMITTER_TESTS),$(TESTS_A_TO_E))
	TF_USE_LEGACY_KERAS=0 $(PYTEST) --durations=10 -m "not slow and not multiworker" \
	  $(filter-out $(KERAS_FREE_BESIDE_TF_KERAS) $(TESTS_A_TO_E) $(DEFAULT_EMITTER_TESTS),$(TESTS_FIRST_HALF))
	TF_USE_LEGACY_KERAS=0 $(PYTEST) --durations=10 -m "not slow and not multiworker" \
	  $(filter-out $(KERAS_FREE_BESIDE_TF_KERAS) $(DEFAULT_EMITTER_TESTS),$(TESTS_SECOND_HALF))
	$(DEFAULT_EMITTERS) TF_USE_LEGACY_KERAS=0 $(PYTEST) --durations=5 \
	  -m "not slow and not multiworker" $(DEFAULT_EMITTER_TESTS)

test-tf-keras-local: $(STAMP)
	TF_USE_LEGACY_KERAS=1 $(PYTEST) --durations=10 -m "not slow and not keras_free and not multiworker" \
	  $(TESTS_FIRST_HALF)
	TF_USE_LEGACY_KERAS=1 $(PYTEST) --durations=10 -m "not slow and not keras_free and not multiworker" \
	  $(TESTS_SECOND_HALF)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) --durations=5 -m "not slow and not multiworker" \
	  $(KERAS_FREE_BESIDE_TF_KERAS)

example-%: $(STAMP)
	$(PY) examples/$*.py

# On a GPU machine: the battery, the equivalence, precision and GPU tests and
# every MirroredStrategy test (over two logical GPUs, NCCL all-reduce), per
# flavour, with TensorFlow's defaults (TF32 on) and again with TF32 off; and
# the batched least-squares files (Keras-free: with the Keras 3 run only).
GPU_TESTS := tests/test_battery.py tests/test_gradient_accumulator.py \
	tests/test_precision.py tests/test_gpu_state.py tests/test_gpu.py \
	tests/test_levenberg_marquardt.py tests/test_projections.py tests/test_spd.py
GPU_LSQ_TESTS := tests/test_small_fits.py tests/test_batched_least_squares.py \
	tests/test_gpufit_conformance.py
test-gpu: $(STAMP)
	@if $(PY) -c "import sys, tensorflow as tf; sys.exit(0 if tf.config.list_physical_devices('GPU') else 1)" 2>/dev/null; then \
	  for tf32 in default 0; do for legacy in 0 1; do \
	    echo "== test-gpu: TF_USE_LEGACY_KERAS=$$legacy, TF32 $$tf32 =="; \
	    run="env TF_GRADKIT_TWO_GPUS=1 TF_USE_LEGACY_KERAS=$$legacy $$( [ $$tf32 = 0 ] && echo NVIDIA_TF32_OVERRIDE=0 )"; \
	    $$run $(PYTEST) -m "not slow" $(GPU_TESTS) || exit 1; \
	    [ $$legacy = 1 ] || $$run $(PYTEST) -m "not slow" $(GPU_LSQ_TESTS) || exit 1; \
	    $$run $(PYTEST) -m "distributed and not slow" tests || exit 1; \
	  done; done; \
	else \
	  echo "test-gpu: no GPU is visible to TensorFlow here, so nothing ran on a GPU."; \
	  echo "test-gpu: run it on a machine with an NVIDIA GPU (see docs/gpu_and_xla.md)."; \
	fi

test-slow: $(STAMP)
	TF_USE_LEGACY_KERAS=0 $(PYTEST) -m slow $(addprefix --ignore=,$(DEFAULT_EMITTER_TESTS))
	$(DEFAULT_EMITTERS) TF_USE_LEGACY_KERAS=0 $(PYTEST) -m slow $(DEFAULT_EMITTER_TESTS)
	TF_USE_LEGACY_KERAS=1 $(PYTEST) -m "slow and not keras_free"

# Not part of `make test` (it downloads several GB the first time): build the
# wheel and sdist, install the wheel into a fresh venv per pinned row (oldest,
# a middle and the newest TensorFlow, the oldest Keras 3) under .compat/, run
# the tests there per flavour and print the table (docs/compatibility.md).
# `make test-compat TESTS="tests/test_projected.py" ROWS="tf2.16"` runs a part.
test-compat:
	PYTHON="$(PYTHON)" ./scripts/compat.sh

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	# The peers pin TensorFlow 2.13 and numpy<=1.23.2 in their metadata but run
	# on TF 2.21 (shared/ANCHORS.md); --no-deps keeps our environment intact.
	$(PY) -m pip install -q --no-deps gradient-accumulator tf-levenberg-marquardt
	$(PY) benchmarks/accumulation.py
	$(PY) benchmarks/accumulation_loop.py
	$(PY) benchmarks/lm_sinc.py
	$(PY) benchmarks/lm_memory.py
	$(PY) benchmarks/spd_solve.py
	$(PY) benchmarks/nist_table.py
	$(PY) benchmarks/constraints.py
	$(PY) benchmarks/frank_wolfe.py
	$(PY) benchmarks/pruning.py
	$(PY) benchmarks/pruning_keras3.py
	$(PY) benchmarks/distributed.py

clean:
	rm -rf $(VENV) build *.egg-info
