#!/usr/bin/env bash
# Builds the docs site (mkdocs.yml, docs/) into build/site with warnings as errors. Needs
# .venv (scripts/setup.sh); installs MkDocs Material and mkdocstrings into it, once. Run by
# scripts/test.sh, so by CI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
[ -x "$VPY" ] || { echo "docs: run scripts/setup.sh first (no .venv)" >&2; exit 1; }
STATE="$ROOT/.venv/jax_moe_comm-setup"
mkdir -p "$STATE"
# ruff formats the signatures mkdocstrings shows.
REQUIREMENTS=("mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings-python>=1.10" ruff)
req_key=$(printf '%s\n' "${REQUIREMENTS[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$STATE/docs-requirements" 2>/dev/null)" != "$req_key" ]; then
  echo "docs: installing MkDocs into .venv"
  "$VPY" -m pip install -q --disable-pip-version-check "${REQUIREMENTS[@]}"
  echo "$req_key" > "$STATE/docs-requirements"
fi
t0=$(date +%s)
# --strict: a broken link, a missing page or a docstring mkdocstrings cannot render fails.
PATH="$ROOT/.venv/bin:$PATH" NO_MKDOCS_2_WARNING=1 "$VPY" -m mkdocs build --strict --quiet \
  --site-dir "$ROOT/build/site"
echo "docs: built build/site ($(find "$ROOT/build/site" -name index.html | wc -l) pages," \
     "mkdocs build --strict) in $(( $(date +%s) - t0 )) s"
