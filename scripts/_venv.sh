# Sourced by the scripts beside it: make ./.venv with gpumemd installed (editable) and
# activate it. Says what it does: a first run installs for a minute or so.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
me="scripts/$(basename "$0")"
if [ ! -x .venv/bin/python ]; then
    echo "$me: making ./.venv, a virtual environment for gpumemd (first run only)" >&2
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.gpumemd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "$me: installing gpumemd into ./.venv (editable, with its test tools; pip builds the native module: about a minute)..." >&2
    started=$SECONDS
    # The editable build puts the native module beside its sources; one left from an
    # older build (another file suffix: cpython-3XX before abi3) would shadow the new one.
    rm -f shared/gpumem_shared/_native.*.so
    python -m pip install -q --disable-pip-version-check -e '.[test]'
    touch "$stamp"
    echo "$me: installed in $((SECONDS - started)) s. From another shell, '. .venv/bin/activate' puts gpumemd and gpumemctl on PATH (or run .venv/bin/gpumemctl)" >&2
fi
