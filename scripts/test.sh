#!/usr/bin/env bash
# Run the test suite (unit + integration on the host backend; GPU tests skip without a GPU).
# On a GPU machine, scripts/test.sh -m gpu runs the same scenarios on the CUDA backend.
. "$(dirname "$0")/_venv.sh"
if ! command -v systemd-analyze >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    # tests/integration verify the systemd unit with systemd-analyze
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
fi
exec python -m pytest "$@"
