"""A stand-in for a Kubernetes DRA driver's node plugin, as gpumemd's tenant caps expect
one (docs/architecture.md, "Tenant caps"): on NodePrepareResources it writes the claim's
directory under the daemon's --tenant-claims root, with ``tenant.json`` naming the
tenant and the device bytes the claim consumed, and hands the pod the daemon's runtime
directory there (a real driver does it with a CDI mount of that directory at the path
in ``GPUMEMD_RUNTIME_DIR``; here a symlink in the claim's directory); on
NodeUnprepareResources it removes the directory. Then it tells the daemon (SIGHUP).
A claim may name its tenant by a token instead of a uid (``prepare_token``): the driver
makes a random token, hands the pod the token in its claim's directory and the daemon
its SHA-256 in ``tenant.json``, so pods that all run as one uid are tenants apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
from pathlib import Path
from typing import Any

CLAIM_FILE = "tenant.json"  # gpumemd.caps.CLAIM_FILE
RUNTIME_LINK = "gpumemd"  # where the pod finds the daemon's sockets
TOKEN_FILE = "tenant-token"  # the pod's tenant token, readable by its uid alone


class FakeDraDriver:
    def __init__(self, claims_root: Path, runtime_dir: Path, daemon_pid: int) -> None:
        self.claims_root = claims_root
        self.runtime_dir = runtime_dir
        self.daemon_pid = daemon_pid
        claims_root.mkdir(parents=True, exist_ok=True)

    def prepare(self, claim_uid: str, uid: int, consumed: int) -> Path:
        """The claim's directory; the daemon has been told to read it."""
        return self._prepare(claim_uid, {"uid": uid, "bytes": consumed})

    def prepare_token(self, claim_uid: str, consumed: int, pod_uid: int | None = None) -> Path:
        """A claim whose tenant is a token: its directory, with the token in TOKEN_FILE
        (owned by ``pod_uid``, mode 0400); the daemon gets only the token's SHA-256."""
        token = secrets.token_hex(32)
        tenant = {"token_sha256": hashlib.sha256(token.encode()).hexdigest(), "bytes": consumed}
        return self._prepare(claim_uid, tenant, token, pod_uid)

    def _prepare(self, claim_uid: str, tenant: dict[str, Any], token: str = "", pod_uid: int | None = None) -> Path:
        claim = self.claims_root / claim_uid
        claim.mkdir()
        (claim / RUNTIME_LINK).symlink_to(self.runtime_dir)
        if token:  # before the daemon learns of the claim: the pod may start at once
            fd = os.open(claim / TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
            with os.fdopen(fd, "w") as f:
                f.write(token + "\n")
            if pod_uid is not None:
                os.chown(claim / TOKEN_FILE, pod_uid, -1)
        # Written whole then renamed: the daemon never reads half a file.
        tmp = claim / f".{CLAIM_FILE}.tmp"
        tmp.write_text(json.dumps(tenant))
        os.rename(tmp, claim / CLAIM_FILE)
        os.kill(self.daemon_pid, signal.SIGHUP)
        return claim

    def unprepare(self, claim_uid: str) -> None:
        shutil.rmtree(self.claims_root / claim_uid)
        os.kill(self.daemon_pid, signal.SIGHUP)

    def pod_env(self, claim: Path) -> dict[str, str]:
        """What the CDI spec sets in the engine's container."""
        return {"GPUMEMD_RUNTIME_DIR": str(claim / RUNTIME_LINK)}
