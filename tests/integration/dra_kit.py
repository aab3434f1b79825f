"""A stand-in for a Kubernetes DRA driver's node plugin, as gpumemd's tenant caps expect
one (docs/architecture.md, "Tenant caps"): on NodePrepareResources it writes the claim's
directory under the daemon's --tenant-claims root, with ``tenant.json`` naming the
tenant and the device bytes the claim consumed, and hands the pod the daemon's runtime
directory there (a real driver does it with a CDI mount of that directory at the path
in ``GPUMEMD_RUNTIME_DIR``; here a symlink in the claim's directory); on
NodeUnprepareResources it removes the directory. Then it tells the daemon (SIGHUP).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

CLAIM_FILE = "tenant.json"  # gpumemd.caps.CLAIM_FILE
RUNTIME_LINK = "gpumemd"  # where the pod finds the daemon's sockets


class FakeDraDriver:
    def __init__(self, claims_root: Path, runtime_dir: Path, daemon_pid: int) -> None:
        self.claims_root = claims_root
        self.runtime_dir = runtime_dir
        self.daemon_pid = daemon_pid
        claims_root.mkdir(parents=True, exist_ok=True)

    def prepare(self, claim_uid: str, uid: int, consumed: int) -> Path:
        """The claim's directory; the daemon has been told to read it."""
        claim = self.claims_root / claim_uid
        claim.mkdir()
        (claim / RUNTIME_LINK).symlink_to(self.runtime_dir)
        # Written whole then renamed: the daemon never reads half a file.
        tmp = claim / f".{CLAIM_FILE}.tmp"
        tmp.write_text(json.dumps({"uid": uid, "bytes": consumed}))
        os.rename(tmp, claim / CLAIM_FILE)
        os.kill(self.daemon_pid, signal.SIGHUP)
        return claim

    def unprepare(self, claim_uid: str) -> None:
        shutil.rmtree(self.claims_root / claim_uid)
        os.kill(self.daemon_pid, signal.SIGHUP)

    def pod_env(self, claim: Path) -> dict[str, str]:
        """What the CDI spec sets in the engine's container."""
        return {"GPUMEMD_RUNTIME_DIR": str(claim / RUNTIME_LINK)}
