"""A stand-in for a Kubernetes DRA driver's node plugin, playing the contract gpumemd's
tenant caps expect of one (docs/architecture.md, "Kubernetes DRA") and nothing more.

NodePrepareResources, for a claim that consumed memory of the GPU whose daemon reads
``claims_root`` (its --tenant-claims): the claim's directory ``claims_root/<claim uid>``,
with the claim's tenant token in TOKEN_FILE (mode 0400, the pod's uid) if it names its
tenant by token, then ``tenant.json`` naming the tenant and the bytes consumed, written
whole and renamed into place; and the CDI edits for the claim's container (``cdi_edits``):
the claim's directory at CLAIM_MOUNT and the daemons' runtime directory at RUNTIME_MOUNT,
both read-only, and the environment that names them. NodeUnprepareResources removes the
directory. The daemon notices both on its own (it watches the directory's listing): no
signal, which a plugin in a pod of its own could not send.

No container runs here: ``pod_env`` is the environment the CDI edits give the container,
each path in it turned into the host path its mount shows there.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

CLAIM_FILE = "tenant.json"  # gpumemd.memory_caps.CLAIM_FILE
TOKEN_FILE = "tenant-token"  # the pod's tenant token, readable by its uid alone
CLAIM_MOUNT = "/run/gpumemd-claim"  # where the container sees its claim's directory
RUNTIME_MOUNT = "/run/gpumemd"  # where the container sees the daemons' sockets
ENV_RUNTIME_DIR = "GPUMEMD_RUNTIME_DIR"  # gpumem.connect(runtime_dir=...); read by connect() itself too
ENV_TOKEN_FILE = "GPUMEMD_TENANT_TOKEN_FILE"  # gpumem.connect(tenant_token_file=...)


class FakeDraDriver:
    def __init__(self, claims_root: Path, runtime_dir: Path) -> None:
        self.claims_root = claims_root
        self.runtime_dir = runtime_dir
        claims_root.mkdir(parents=True, exist_ok=True)

    def prepare(self, claim_uid: str, uid: int, consumed: int) -> Path:
        """A claim whose tenant is the pod's uid: its directory on the node."""
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
        return claim

    def unprepare(self, claim_uid: str) -> None:
        shutil.rmtree(self.claims_root / claim_uid)

    def cdi_edits(self, claim: Path) -> dict[str, Any]:
        """The containerEdits of the CDI spec the driver writes for the claim's device."""
        env = [f"{ENV_RUNTIME_DIR}={RUNTIME_MOUNT}"]
        if (claim / TOKEN_FILE).exists():
            env.append(f"{ENV_TOKEN_FILE}={CLAIM_MOUNT}/{TOKEN_FILE}")
        ro = ["ro", "nosuid", "nodev", "noexec", "rbind"]
        return {
            "env": env,
            "mounts": [
                {"hostPath": str(claim), "containerPath": CLAIM_MOUNT, "options": ro},
                {"hostPath": str(self.runtime_dir), "containerPath": RUNTIME_MOUNT, "options": ro},
            ],
        }

    def pod_env(self, claim: Path) -> dict[str, str]:
        """The environment the CDI edits give the engine's container, its paths as the
        host sees them (the container's mounts, undone)."""
        edits = self.cdi_edits(claim)
        env = {}
        for entry in edits["env"]:
            key, value = entry.split("=", 1)
            mount = next(m for m in edits["mounts"] if value == m["containerPath"] or value.startswith(m["containerPath"] + "/"))
            env[key] = mount["hostPath"] + value[len(mount["containerPath"]) :]
        return env
