#!/usr/bin/env bash
# Run gpumemd for device 0 in the foreground: the CUDA backend where an NVIDIA driver
# and GPU are present, else the host backend (8 GiB of host shared memory).
# Extra arguments go to gpumemd, e.g. scripts/daemon.sh --device 1 --runtime-dir /tmp/gpumemd
. "$(dirname "$0")/_venv.sh"
if python -c 'from gpumem_shared.driver.cuda import visible_device_uuids as v; import sys; sys.exit(0 if v() else 1)' 2>/dev/null; then
    exec gpumemd "$@"
else
    echo "scripts/daemon.sh: no NVIDIA GPU here; using the host backend" >&2
    exec gpumemd --backend host --host-capacity 8GiB "$@"
fi
