"""gpumemd: the per-GPU memory daemon (``gpumemd --device N``)."""

import time

# When the daemon's code began to load: the startup line (startup.py) splits the
# interpreter's start from the imports here.
IMPORT_STARTED = time.clock_gettime(time.CLOCK_BOOTTIME)
