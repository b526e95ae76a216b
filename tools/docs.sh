#!/usr/bin/env bash
# The API reference, checked: docstring coverage of the public API (interrogate over the files that define it, as
# tools/public_api.py lists them; settings in pyproject.toml's [tool.interrogate]), then Sphinx with warnings as
# errors (-W) and every cross-reference resolved (-n), into build/docs/ (open build/docs/index.html).
# Run by tools/test.sh once, in the newest-ORT environment (.venv, which tools/bootstrap.sh gives the docs extra).
#
# Usage: tools/docs.sh [VENV]   (default: .venv; made by tools/bootstrap.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${1:-$root/.venv}
if [ ! -x "$venv/bin/sphinx-build" ] || [ ! -x "$venv/bin/interrogate" ]; then
  echo "docs: $venv has no docs extra (pip install -e '.[docs]', or bash tools/bootstrap.sh for .venv)" >&2
  exit 2
fi
start=$(date +%s)
files=$("$venv/bin/python" tools/public_api.py)  # fails the script where the public API does not import
mapfile -t files <<< "$files"
if ! "$venv/bin/interrogate" -c pyproject.toml "${files[@]}"; then
  echo "docs: public names without a docstring:" >&2
  "$venv/bin/interrogate" -c pyproject.toml -vv "${files[@]}" | grep MISSED >&2 || true
  exit 1
fi
# -E: a fresh environment every time (a stale one would hide a warning of a page that did not change)
rm -rf build/docs  # no page of an earlier build left behind
"$venv/bin/sphinx-build" -W -n -E --keep-going -q -b html docs build/docs
echo "docs: API reference and guides in build/docs/index.html, built in $(( $(date +%s) - start )) s"
