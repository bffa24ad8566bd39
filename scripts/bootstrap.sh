#!/usr/bin/env bash
# Make (or refresh) the project's .venv: torch 2.13.0 CPU from the local wheel first,
# so that no other package can pull a multi-GB CUDA build, then the project itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP=.venv/.inferlab-stamp
WANT=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi
echo "inferlab: setting up .venv (first run only; a few minutes)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >&2
echo 'torch==2.13.0' > .venv/constraints.txt
.venv/bin/python -m pip install -q -c .venv/constraints.txt torch==2.13.0 >&2
.venv/bin/python -m pip install -q -c .venv/constraints.txt -e '.[test]' >&2
echo "$WANT" > "$STAMP"
