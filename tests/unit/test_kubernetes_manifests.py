"""deploy/kubernetes, checked offline: every manifest parses, names what it must, and
keeps the confinement the README claims. The namespace's Pod Security level is the one
the pods need (worked out here from what they use), so a pod that stops needing a host
namespace makes the label too lax and this fails."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e '.[test]'")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
NAMESPACE = "gpumem"
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"
# Pod Security "baseline" forbids these outright; "restricted" asks for more besides.
HOST_NAMESPACES = ("hostPID", "hostIPC", "hostNetwork")


def _documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path, doc))
    return docs


def _pods() -> list[tuple[str, dict[str, Any]]]:
    """Every pod spec: a Pod's own, a workload's template."""
    pods = []
    for _, doc in _documents():
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Pod":
            pods.append((name, doc["spec"]))
        elif "template" in doc.get("spec", {}):
            pods.append((name, doc["spec"]["template"]["spec"]))
    return pods


def _level_needed(pod: dict[str, Any]) -> str:
    """The least Pod Security level that admits ``pod`` (the rules these manifests touch)."""
    containers = pod["containers"] + pod.get("initContainers", [])
    if any(pod.get(key) for key in HOST_NAMESPACES) or any("hostPath" in v for v in pod.get("volumes", [])):
        return "privileged"
    if any(c.get("securityContext", {}).get("privileged") or c.get("ports") and any("hostPort" in p for p in c["ports"]) for c in containers):
        return "privileged"
    if any(c.get("securityContext", {}).get("capabilities", {}).get("add") for c in containers):
        return "baseline"
    run_as_non_root = pod.get("securityContext", {}).get("runAsNonRoot")
    if not all(c.get("securityContext", {}).get("runAsNonRoot", run_as_non_root) for c in containers):
        return "baseline"
    return "restricted"


def test_every_manifest_parses_and_names_what_it_must() -> None:
    assert {p.name for p in MANIFESTS} == {"gpumemd.yaml", "engine-pod.yaml"}
    docs = _documents()
    assert docs
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path.name}: a document without apiVersion or kind"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), f"{path.name}: {doc['metadata']}"
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{path.name}: {doc['kind']} outside namespace {NAMESPACE}"


def test_the_namespace_is_labelled_for_the_level_its_pods_need() -> None:
    (namespace,) = [doc for _, doc in _documents() if doc["kind"] == "Namespace"]
    labels = namespace["metadata"].get("labels", {})
    order = ["restricted", "baseline", "privileged"]
    needed = max((_level_needed(pod) for _, pod in _pods()), key=order.index)
    assert labels.get(PSA_ENFORCE) == needed, f"the pods need Pod Security {needed!r}; the namespace says {labels.get(PSA_ENFORCE)!r}"
    assert labels.get(f"{PSA_ENFORCE}-version"), "the level's version is pinned or 'latest', not left to the cluster's default"


def test_each_host_namespace_says_why() -> None:
    for path in MANIFESTS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"\s*({'|'.join(HOST_NAMESPACES)}):\s*true", line):
                above = lines[i - 1].strip()
                assert "#" in line or above.startswith("#"), f"{path.name}:{i + 1}: {line.strip()} with no reason given beside it"
    # hostNetwork is never needed (metrics listen on the pod's own address), and the
    # daemon's pod takes no IPC namespace (it opens no CUDA IPC handle) nor the host's pid
    # namespace (no pid decides anything: tests/integration/test_pid_namespaces.py).
    pods = dict(_pods())
    assert not any(pod.get("hostNetwork") for pod in pods.values())
    # Nor do the engines' (memops ordering needs no CUDA IPC event between their pods).
    assert not any(pod.get(host) for pod in pods.values() for host in ("hostPID", "hostIPC"))


@pytest.mark.parametrize("name", [name for name, _ in _pods()])
def test_every_pod_is_confined_as_far_as_it_can_be(name: str) -> None:
    pod = dict(_pods())[name]
    pod_security = pod.get("securityContext", {})
    tolerations = pod.get("tolerations", [])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations, "GPU nodes' taint is tolerated"
    for container in pod["containers"]:
        where = f"{name} container {container['name']}"
        security = container.get("securityContext", {})
        seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", where
        assert security.get("allowPrivilegeEscalation") is False, where
        assert security.get("capabilities") == {"drop": ["ALL"]}, where
        assert security.get("readOnlyRootFilesystem") is True, where
        assert not security.get("privileged"), where
        requests = container.get("resources", {}).get("requests", {})
        assert requests.get("cpu") and requests.get("memory"), f"{where}: resource requests"
        assert container["resources"].get("limits", {}).get("memory"), f"{where}: a memory limit"


def _arg(container: dict[str, Any], flag: str) -> str:
    args = container["args"]
    return str(args[args.index(flag) + 1])


def test_the_daemon_containers_hold_together() -> None:
    """What a root daemon with no capability needs from its pod, and what each container
    says about its GPU agreeing with itself."""
    docs = {f"{doc['kind']}/{doc['metadata']['name']}": doc for _, doc in _documents()}
    daemonset = docs["DaemonSet/gpumemd"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    assert daemonset["metadata"]["labels"]["app.kubernetes.io/name"] == "gpumemd"
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    devices = []
    for container in pod["containers"]:
        device = _arg(container, "--device")
        devices.append(device)
        # No CAP_CHOWN: root gives the sockets to the group as a member of it.
        assert int(_arg(container, "--socket-group")) in pod["securityContext"]["supplementalGroups"], container["name"]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts["/run/gpumemd"]["hostPath"]["path"] == "/run/gpumemd"
        assert mounts["/run/gpumemd-devices"]["hostPath"]["path"] == "/run/gpumemd-devices"  # the node's device locks
        assert "emptyDir" in mounts["/tmp"]  # scratch under the read-only root
        assert [p["containerPort"] for p in container["ports"]] == [int(_arg(container, "--metrics-port"))]
        # No hostPID for engines: a namespaced taker cannot open its releaser's CUDA IPC event.
        assert _arg(container, "--lease-ordering") == "memops", container["name"]
        for probe in ("startupProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[command.index("--device") + 1] == device, f"{container['name']}'s {probe} asks another GPU"
    assert len(set(devices)) == len(devices), "one container per GPU"
    engine = docs["Pod/gpumem-smoke"]["spec"]
    groups = {int(_arg(c, "--socket-group")) for c in pod["containers"]}
    assert groups <= set(engine["securityContext"]["supplementalGroups"]), "the engine reaches the sockets by the socket group"
    assert engine["securityContext"].get("runAsNonRoot") is True and engine["securityContext"].get("runAsUser", 0) != 0
