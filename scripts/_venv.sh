# Sourced by the scripts beside it: make ./.venv with gpumemd installed (editable) and activate it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.gpumemd-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    # The editable build puts the native module beside its sources; one left from an
    # older build (another file suffix: cpython-3XX before abi3) would shadow the new one.
    rm -f shared/gpumem_shared/_native.*.so
    python -m pip install -q --disable-pip-version-check -e '.[test]'
    touch "$stamp"
fi
