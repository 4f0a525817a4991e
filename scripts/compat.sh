#!/usr/bin/env bash
# `make test-compat`: build the wheel and sdist, install the WHEEL (not
# editable) into a fresh virtual environment per row of pinned versions, and
# run the tests there once per Keras flavour (each flavour its own process),
# from a copy of tests/ (with docs/ and examples/, as the sdist lays them out)
# outside the package, so that the installed wheel is what is imported.
# Downloads several GB the first time (pip's cache keeps them).
#
# Variables (environment or `make test-compat VAR=...`):
#   PYTHON   the interpreter the venvs are made from (default python3)
#   ROWS     which rows to run, by label (default: all of them, below)
#   TESTS    test files or node ids, relative to the repository root
#            (default: every tests/test_*.py)
#   MARK3    pytest -m for the Keras 3 process
#   MARK2    pytest -m for the tf_keras process
#   REUSE=1  keep a row's venv if it exists (reinstall only the wheel)
#   SDIST_TESTS  test files run from the unpacked sdist, installed from the
#            sdist into the last row's venv ("" skips that check)
#   BUILD=0  reuse .compat/dist and .compat/run from an earlier run (to run
#            rows side by side: one build, then one process per ROWS)
#   TAG      results go to .compat/results-$TAG.md (default results.md)
#   FLAVOURS which processes to run, "keras3", "tf_keras" or both (default
#            "keras3 tf_keras"); a row's own flavours still limit it, and
#            the cell of a flavour left out reads "not run"
# Results: .compat/results.md (a table) and .compat/logs/<row>-<flavour>.log.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=$ROOT/.compat
TESTS=${TESTS:-$(ls tests/test_*.py | tr '\n' ' ')}
MARK3=${MARK3:-not slow and not multiworker}
MARK2=${MARK2:-not slow and not keras_free and not multiworker}
SDIST_TESTS=${SDIST_TESTS-tests/test_projected.py tests/test_save_load.py}
FLAVOURS=${FLAVOURS:-keras3 tf_keras}
for f in $FLAVOURS; do
  case $f in keras3|tf_keras) ;; *)
    echo "FLAVOURS: got '$f'; accepted: keras3, tf_keras (space-separated)"; exit 1;; esac
done

# label | pip requirements pinned for the row [| flavours, default both]
# Keras 3 before 3.10 lacks what the Keras 3 host uses (Variable's
# `synchronization`, `add_optimizer_variables`): 3.5 and 3.8 fail
# (docs/compatibility.md). The Keras 3.10 row runs the Keras 3 process only:
# its tf_keras process would be the tf2.16 row's (the same tf_keras).
ALL_ROWS=(
  "tf2.16|tensorflow==2.16.2 tf_keras==2.16.0 tensorflow-model-optimization==0.8.0"
  "tf2.16-keras3.10|tensorflow==2.16.2 tf_keras==2.16.0 keras==3.10.0 tensorflow-model-optimization==0.8.0|keras3"
  "tf2.18|tensorflow==2.18.1 tf_keras==2.18.0 tensorflow-model-optimization==0.8.0"
  "tf2.21|tensorflow==2.21.0 tf_keras==2.21.0 tensorflow-model-optimization==0.8.1"
)
ROWS=${ROWS:-$(for r in "${ALL_ROWS[@]}"; do printf '%s ' "${r%%|*}"; done)}

mkdir -p "$OUT/logs"
RESULTS=$OUT/results${TAG:+-$TAG}.md
if [ "${BUILD:-1}" = 0 ]; then
  WHEEL=$(ls "$OUT"/dist/*.whl) && SDIST=$(ls "$OUT"/dist/*.tar.gz) || exit 1
  RUN=$OUT/run
else
echo "== building the wheel and sdist"
if [ ! -x "$OUT/tool/bin/python" ]; then
  "$PYTHON" -m venv "$OUT/tool" && "$OUT/tool/bin/python" -m pip install -q build || exit 1
fi
rm -rf "$OUT/dist"
"$OUT/tool/bin/python" -m build -q --outdir "$OUT/dist" "$ROOT" >"$OUT/logs/build.log" 2>&1 \
  || { cat "$OUT/logs/build.log"; exit 1; }
WHEEL=$(ls "$OUT"/dist/*.whl)
SDIST=$(ls "$OUT"/dist/*.tar.gz)
echo "   $WHEEL"; echo "   $SDIST"

# The tests as the sdist lays them out, away from the package's source.
RUN=$OUT/run
rm -rf "$RUN" && mkdir -p "$RUN"
cp -r tests docs examples "$RUN"/
printf '[pytest]\n' >"$RUN/pytest.ini"
sed -n '/^\[tool:pytest\]/,/^\[/p' setup.cfg | sed '1d;/^\[/d' >>"$RUN/pytest.ini"
fi

summary() {  # the counts on pytest's last line, or what went wrong
  local line
  line=$(grep -E '^=*.*(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' "$1" | tail -1 \
         | sed -E 's/^=+ //; s/ =+$//; s/ in [0-9.]+s.*//')
  echo "${line:-did not run (see $1)}"
}

TABLE="| row | TensorFlow | keras | tf_keras | numpy | tfmot | Keras 3 process | tf_keras process |"
TABLE+=$'\n'"|---|---|---|---|---|---|---|---|"
LAST_VENV=
for label in $ROWS; do
  spec=
  for r in "${ALL_ROWS[@]}"; do [ "${r%%|*}" = "$label" ] && spec=${r#*|}; done
  [ -n "$spec" ] || { echo "unknown row $label"; exit 1; }
  flavours="keras3 tf_keras"
  case "$spec" in *"|"*) flavours=${spec#*|}; spec=${spec%%|*};; esac
  VENV=$OUT/venv-$label
  echo "== $label: $spec"
  if [ "${REUSE:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1
  fi
  if ! "$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL" \
          >"$OUT/logs/$label-install.log" 2>&1 \
     || ! "$VENV/bin/python" -m pip install -q "$WHEEL[test]" $spec \
          >>"$OUT/logs/$label-install.log" 2>&1; then
    echo "   install failed: $OUT/logs/$label-install.log"; tail -5 "$OUT/logs/$label-install.log"
    TABLE+=$'\n'"| $label | $spec | | | | | install failed | install failed |"
    continue
  fi
  versions=$(cd "$RUN" && TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/python" - <<'PY' 2>/dev/null
from importlib.metadata import version
print(" | ".join(version(p) for p in
      ("tensorflow", "keras", "tf_keras", "numpy", "tensorflow-model-optimization")))
PY
)
  where=$(cd "$RUN" && TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/python" -c \
          "import tf_gradkit; print(tf_gradkit.__file__)" 2>/dev/null)
  echo "   tf_gradkit imported from $where"
  case "$where" in "$VENV"/lib/*/site-packages/*) ;; *)
    echo "   not the installed wheel: stopping"; exit 1;; esac
  cells=
  for flavour in keras3 tf_keras; do
    case " $flavours " in *" $flavour "*) ;; *) cells+=" not run |"; continue;; esac
    case " $FLAVOURS " in *" $flavour "*) ;; *) cells+=" not run |"; continue;; esac
    if [ $flavour = keras3 ]; then legacy=0; mark=$MARK3; else legacy=1; mark=$MARK2; fi
    log=$OUT/logs/$label-$flavour.log
    (cd "$RUN" && TF_USE_LEGACY_KERAS=$legacy TF_CPP_MIN_LOG_LEVEL=2 \
       "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rfEs -m "$mark" $TESTS) >"$log" 2>&1
    cells+=" $(summary "$log") |"
    echo "   $flavour: $(summary "$log")"
  done
  TABLE+=$'\n'"| $label | $versions |$cells"
  LAST_VENV=$VENV
done

if [ -n "$SDIST_TESTS" ] && [ -n "$LAST_VENV" ]; then
  echo "== the sdist runs its own tests ($SDIST_TESTS), installed into $(basename "$LAST_VENV")"
  rm -rf "$OUT/sdist" && mkdir -p "$OUT/sdist" && tar -xzf "$SDIST" -C "$OUT/sdist"
  SRC=$(ls -d "$OUT"/sdist/*/)
  "$LAST_VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$SRC" \
      >"$OUT/logs/sdist-install.log" 2>&1 || { echo "   sdist install failed"; exit 1; }
  for flavour in $FLAVOURS; do
    if [ $flavour = keras3 ]; then legacy=0; mark=$MARK3; else legacy=1; mark=$MARK2; fi
    log=$OUT/logs/sdist-$flavour.log
    # bin/pytest, not python -m pytest: the cwd stays off sys.path, so the
    # tf_gradkit installed from the sdist is the one imported.
    (cd "$SRC" && TF_USE_LEGACY_KERAS=$legacy TF_CPP_MIN_LOG_LEVEL=2 \
       "$LAST_VENV/bin/pytest" -q -p no:cacheprovider -rfE -m "$mark" $SDIST_TESTS) >"$log" 2>&1
    echo "   sdist $flavour: $(summary "$log")"
  done
  "$LAST_VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL" >/dev/null 2>&1
fi

{ echo "Run $(date -u +%Y-%m-%d) with $("$PYTHON" --version 2>&1) on $(uname -sm)."
  echo "Tests: $TESTS"; echo "Flavours: $FLAVOURS"; echo "Keras 3 process: -m \"$MARK3\"; tf_keras process: -m \"$MARK2\"."
  echo; echo "$TABLE"; } >"$RESULTS"
echo; cat "$RESULTS"
grep -q -E 'failed|error|did not run|install failed' "$RESULTS" && exit 1
exit 0
