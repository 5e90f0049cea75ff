#!/usr/bin/env bash
# Run every CPU test module alone, in a fresh pytest process, at each thread count given (default: 1 and 2):
# a module that passes only after another one (a registration, a leaked thread count, a cache) fails here.
# Too slow for CI on 2 cores (a process per module and thread count, ~2x the suite); run it before a release
# and when tests/conftest.py's state handling changes. CI runs the suite in reversed module order instead
# (docs/ci_notes.md).
#
#   tools/run_alone.sh                    # every tests/test_*.py and tests/reliability/test_*.py, 1 and 2 threads
#   THREADS="2" tools/run_alone.sh tests/test_ray.py tests/test_trainer.py
#
# Prints one line per module and thread count; exits 1 if any failed (their output is in $LOGDIR).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-"1 2"}
MARKERS=${MARKERS:-"not gpu and not browser and not interpreted"}
LOGDIR=${LOGDIR:-$(mktemp -d -t run_alone.XXXXXX)}
mkdir -p "$LOGDIR"
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(tests/test_*.py tests/reliability/test_*.py)
failed=0
for n in $THREADS; do
  for f in "${modules[@]}"; do
    # tests/reliability/ repeats some tests/ names (test_data.py, test_rewards.py): keep the folder in the log name
    rel=${f#tests/}
    rel=${rel%.py}
    log="$LOGDIR/${rel//\//.}.t$n.log"
    start=$SECONDS
    OMP_NUM_THREADS=$n PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -x -q -p no:cacheprovider \
      -m "$MARKERS" "$f" >"$log" 2>&1
    rc=$?
    # 5: every test of the module deselected by the markers (a GPU-only module)
    if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then status=ok; else status="FAILED (rc $rc, $log)"; failed=1; fi
    printf '%-48s threads=%s %4ss  %s  %s\n' "$f" "$n" $((SECONDS - start)) "$(tail -n 1 "$log")" "$status"
  done
done
exit $failed
