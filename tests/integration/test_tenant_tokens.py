"""Tenants by token across real processes (memory_caps.py): clients of one uid (engine pods that
all run as the same user) that present different tenant tokens at HELLO are held to
separate caps, a client that presents none to its uid's rule, and one whose token no
rule names is refused at HELLO; no refusal, status or log line carries a token. And a
DRA claim that names its tenant by token, the pod reading the token its claim's
directory holds (dra_kit). On both backends: the caps are checked where chunks are made.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import child_env
from dra_kit import ENV_TOKEN_FILE, TOKEN_FILE, FakeDraDriver
from gpumemd_testkit import GiB, MiB, do, status, wait_status
from test_grants import ctl
from test_tenant_caps import refused, tenants


def token_file(directory: Path, name: str, token: str) -> Path:
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")  # as a Secret's file often ends: the client drops the newline
    return path


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_one_uid_with_two_tokens_is_two_tenants_a_wrong_token_is_refused_and_none_is_the_uids(  # type: ignore[no-untyped-def]
    daemon_factory, backend, run_client, runtime_dir, tmp_path
) -> None:
    uid = os.getuid()
    alpha, beta, wrong = (secrets.token_hex(32) for _ in range(3))
    policy = tmp_path / "tenants.toml"
    policy.write_text(
        f'[[tenant]]\ntoken_sha256 = "{sha(alpha)}"\nname = "team-a"\nmax = "64MiB"\n'
        f'[[tenant]]\ntoken_sha256 = "{sha(beta)}"\nname = "team-b"\nmax = "32MiB"\n'
        f'[[tenant]]\nuid = {uid}\nmax = "16MiB"\n'
    )
    d = daemon_factory(backend, args=["--tenant-policy", str(policy)])
    a = run_client("shell", "pod-a", "--tenant-token-file", str(token_file(tmp_path, "a", alpha)))
    b = run_client("shell", "pod-b", "--tenant-token-file", str(token_file(tmp_path, "b", beta)))
    plain = run_client("shell", "plain")
    for c, arena in ((a, "xa"), (b, "xb"), (plain, "xp")):  # arena names are per uid: one namespace for all three
        c.expect("CONNECTED")
        do(c, f"create {arena} {GiB}")

    # A token no rule names: refused at HELLO, typed, naming no secret; no session stays.
    intruder = run_client("shell", "intruder", "--tenant-token-file", str(token_file(tmp_path, "wrong", wrong)))
    line = intruder.expect("ERR ")
    assert line.startswith("PermissionDenied ") and "names no tenant" in line, line
    intruder.finish()

    # Same uid, three tenants: each token its own cap, no token the uid's rule.
    assert int(do(a, f"commit xa {64 * MiB}")) == 64 * MiB
    refused(a, f"commit xa {66 * MiB}", "token team-a holds 64 MiB", "cap of 64 MiB", str(policy))
    assert int(do(b, f"commit xb {32 * MiB}")) == 32 * MiB
    refused(b, f"commit xb {34 * MiB}", "token team-b holds 32 MiB", "cap of 32 MiB")
    assert int(do(plain, f"commit xp {16 * MiB}")) == 16 * MiB
    refused(plain, f"commit xp {18 * MiB}", f"uid {uid} holds 16 MiB", "cap of 16 MiB")

    s = status(runtime_dir)
    assert {c["name"]: c["tenant"] for c in s["clients"]} == {"pod-a": "token team-a", "pod-b": "token team-b", "plain": f"uid {uid}"}
    assert {t: (r["used_bytes"], r["max_bytes"]) for t, r in tenants(runtime_dir).items()} == {
        "token team-a": (64 * MiB, 64 * MiB), "token team-b": (32 * MiB, 32 * MiB), f"uid {uid}": (16 * MiB, 16 * MiB),
    }
    out = ctl(runtime_dir, "status")
    assert "token team-a" in out and "token team-b" in out
    seen = json.dumps(s) + out + d.log() + line
    for secret in (alpha, beta, wrong):
        assert secret not in seen and sha(secret) not in seen, "a token (or its digest) left the daemon"
    for c in (a, b, plain):
        c.send("exit")
        c.finish()
    wait_status(runtime_dir, lambda s: s["device"]["accounted_bytes"] == 0, 10.0, "every tenant's memory given back")


def test_a_dra_claim_names_its_tenant_by_token_and_its_pod_presents_it(  # type: ignore[no-untyped-def]
    daemon_factory, backend, run_client, runtime_dir, tmp_path
) -> None:
    claims = tmp_path / "claims"
    claims.mkdir()
    daemon_factory(backend, args=["--tenant-claims", str(claims)])
    driver = FakeDraDriver(claims, runtime_dir)
    first, second = driver.prepare_token("5b1e-claim", 48 * MiB), driver.prepare_token("9c2f-claim", 24 * MiB)
    wait_status(runtime_dir, lambda s: len(s["tenants"]) == 2, 5.0, "both claims' caps")
    # Two pods of one uid, each knowing only what its claim's CDI edits give it: the
    # daemon's runtime directory and the token file, passed to connect() as an engine does.
    pods = []
    for name, claim in (("pod-1", first), ("pod-2", second)):
        env = driver.pod_env(claim)
        assert Path(env[ENV_TOKEN_FILE]) == claim / TOKEN_FILE
        pod = run_client("shell", name, "--tenant-token-file", env[ENV_TOKEN_FILE], env=child_env(runtime_dir, **env))
        pod.expect("CONNECTED")
        do(pod, f"create kv-{name} {GiB}")
        pods.append(pod)
    do(pods[0], f"commit kv-pod-1 {48 * MiB}")
    refused(pods[0], f"commit kv-pod-1 {50 * MiB}", "token 5b1e-claim holds 48 MiB", "claim 5b1e-claim")
    do(pods[1], f"commit kv-pod-2 {24 * MiB}")
    refused(pods[1], f"commit kv-pod-2 {26 * MiB}", "token 9c2f-claim holds 24 MiB")
    # The claim goes (its pod was deleted): its token names no tenant any more.
    for pod in pods:
        pod.send("exit")
        pod.finish()
    kept = token_file(tmp_path, "kept", (first / TOKEN_FILE).read_text().strip())  # a copy someone kept
    driver.unprepare("5b1e-claim")
    wait_status(runtime_dir, lambda s: len(s["tenants"]) == 1, 5.0, "the first claim's cap gone")
    stale = run_client("shell", "stale", "--tenant-token-file", str(kept))
    assert stale.expect("ERR ").startswith("PermissionDenied ")
    stale.finish()
    late = run_client("shell", "late", "--tenant-token-file", str(second / TOKEN_FILE))
    late.expect("CONNECTED")
    late.send("exit")
    late.finish()


def test_the_dra_manifests_engine_runs_with_what_its_claim_gives_it(daemon_factory, runtime_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """deploy/kubernetes/engine-pod-dra.yaml's own command, in the environment the claim's
    CDI edits give it (dra_kit): it connects through the runtime directory named there and
    counts against the claim's tenant by the token file named there."""
    yaml = pytest.importorskip("yaml")
    manifest = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "engine-pod-dra.yaml"
    (pod,) = [doc for doc in yaml.safe_load_all(manifest.read_text()) if doc["kind"] == "Pod"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][:2] == ["python", "-c"]
    claims = tmp_path / "claims"
    claims.mkdir()
    daemon_factory("host", args=["--tenant-claims", str(claims)])
    driver = FakeDraDriver(claims, runtime_dir)
    claim = driver.prepare_token("7d3a-claim", 40 * MiB)
    wait_status(runtime_dir, lambda s: len(s["tenants"]) == 1, 5.0, "the claim's cap")
    env = child_env(runtime_dir, **driver.pod_env(claim))  # GPUMEMD_RUNTIME_DIR: the claim's
    done = subprocess.run([sys.executable, "-c", container["command"][2]], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("token 7d3a-claim [TenantCapStatus(tenant='token 7d3a-claim', max_bytes=41943040"), done.stdout
