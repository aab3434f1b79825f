#!/usr/bin/env bash
# Run the test suite (unit + integration on the host backend; GPU tests skip without a GPU).
# On a GPU machine, scripts/test.sh -m gpu runs the same scenarios on the CUDA backend.
# It installs nothing outside ./.venv: a tool the tests want and this machine lacks is
# named here, and the tests that need it skip, saying so in the summary.
. "$(dirname "$0")/_venv.sh"
if ! command -v systemd-analyze >/dev/null 2>&1; then
    echo "scripts/test.sh: systemd-analyze is not installed: the tests that verify the systemd unit with it skip" \
         "(to run them: apt-get install systemd, or dnf install systemd)" >&2
fi
exec python -m pytest -q "$@"
