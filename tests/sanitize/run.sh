#!/usr/bin/env bash
# `make test-sanitize`: eventbus/_speedups.c under AddressSanitizer and UndefinedBehaviorSanitizer.
#
# The extension is built with -fsanitize=address,undefined into a copy of the source tree
# in a temporary directory, never in place: the checkout's own eventbus/_speedups*.so is
# left as it is. Then, from that copy, on the compiled path:
#   1. the core tests (the Makefile's PURE_TESTS), and
#   2. tests/sanitize/leakcheck.py: 100,000 calls of each fast-path shape, checking that
#      nothing leaks (see its docstring for how).
# Python itself is not instrumented: libasan is preloaded, PYTHONMALLOC=malloc sends every
# Python object through malloc (so a freed object is poisoned and a use after free, say
# from a missing Py_INCREF, is reported), and leak detection is off (CPython keeps
# allocations alive until exit by design). A sanitizer report aborts the run.
#
# Usage: tests/sanitize/run.sh PYTHON [TEST...]   (the Makefile passes .venv's python and
# PURE_TESTS; KEEP=1 keeps the temporary tree).
set -euo pipefail
PY=${1:?usage: $0 PYTHON [TEST...]}
shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
case "$PY" in  # an absolute path: the steps below run in another directory
  */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;;
  *) PY=$(command -v "$PY") ;;
esac
CC=${CC:-$("$PY" -c 'import sysconfig; print((sysconfig.get_config_var("CC") or "cc").split()[0])')}
if ! command -v "$CC" >/dev/null; then
  echo "test-sanitize: no C compiler ($CC): nothing to sanitize"; exit 1
fi
LIBASAN=$("$CC" -print-file-name=libasan.so)
if [ ! -e "$LIBASAN" ]; then
  echo "test-sanitize: $CC has no libasan.so (install libasan / gcc's sanitizer runtime)"; exit 1
fi

TREE=$(mktemp -d "${TMPDIR:-/tmp}/eventbus-sanitize.XXXXXX")
if [ -z "${KEEP:-}" ]; then trap 'rm -rf "$TREE"' EXIT; else echo "tree kept: $TREE"; fi
start=$(date +%s)

# The tree as git sees it (tracked and new files, not ignored ones: no .so, no venv).
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
   | tar --null -T - -cf -) | tar -xf - -C "$TREE"
SUFFIX=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
INCLUDE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
echo "== building eventbus/_speedups$SUFFIX with -fsanitize=address,undefined"
"$CC" -shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=all -Wall -I"$INCLUDE" "$TREE/eventbus/_speedups.c" \
  -o "$TREE/eventbus/_speedups$SUFFIX"

# libstdc++ too, loaded with libasan: torch throws C++ exceptions (a TCPStore timeout, say),
# and ASan's __cxa_throw interceptor aborts when libstdc++ came after it.
LIBSTDCXX=$("$CC" -print-file-name=libstdc++.so)
export LD_PRELOAD="$LIBASAN $LIBSTDCXX${LD_PRELOAD:+ $LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export PYTHONMALLOC=malloc
export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
unset EVENTBUS_PURE_PYTHON
cd "$TREE"
# Make sure the sanitized build is the one under test, not the checkout's.
"$PY" -c 'import eventbus._compiled as c, sys
m = c.speedups
assert m is not None and m.__file__.startswith(sys.argv[1]), m
print("== compiled path under test:", m.__file__)' "$TREE"

echo "== core tests, compiled path, under the sanitizers"
# -s: pytest must not capture stderr, or a sanitizer's report dies with the process.
"$PY" -m pytest -q -s -p no:cacheprovider -m "not slow" "$@"
echo "== fast paths, 100,000 calls each: leaks"
"$PY" tests/sanitize/leakcheck.py
echo "== test-sanitize passed in $(( $(date +%s) - start )) s"
