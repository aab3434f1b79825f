"""deploy/kubernetes, checked offline: every manifest parses, validates against the
Kubernetes API schemas (kubernetes-validate's copies, strict: no unknown field), names
what it must, and keeps the confinement docs/running.md claims. Each namespace's Pod Security
level is the one its pods need (worked out here from what they use), so a pod that stops
needing a host namespace makes the label too lax, and one that starts needing one makes
it too strict, and this fails. The DRA engine pod must need no more than "restricted"."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: pip install -e '.[test]'")

TESTS = Path(__file__).resolve().parents[1]
DEPLOY = TESTS.parent / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
NAMESPACE = "gpumem"  # gpumemd's, and the hostPath engine pod's
DRA_NAMESPACE = "gpumem-engines"  # engine pods that reach gpumemd through a DRA claim
CLUSTER_SCOPED = ("Namespace", "DeviceClass")
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"
# Pod Security "baseline" forbids these outright; "restricted" asks for more besides.
HOST_NAMESPACES = ("hostPID", "hostIPC", "hostNetwork")
# The volume types "restricted" allows (hostPath is the one these manifests would use).
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
# The schemas the objects are checked against: the oldest Kubernetes that serves each
# object as written (resource.k8s.io/v1 and a pod's resourceClaimTemplateName: 1.34),
# and the newest kubernetes-validate carries.
OLDEST, OLDEST_DRA, NEWEST = "1.30.0", "1.34.0", "1.37.0"


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


def _namespace_of(name: str) -> str:
    return next(doc["metadata"]["namespace"] for _, doc in _documents() if f"{doc['kind']}/{doc['metadata']['name']}" == name)


def _level_needed(pod: dict[str, Any]) -> str:
    """The least Pod Security level that admits ``pod``: the rules of "baseline" and
    "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards) that a pod
    spec here can break; AppArmor, SELinux, /proc mounts and sysctls are used by none."""
    containers = pod["containers"] + pod.get("initContainers", [])
    pod_security = pod.get("securityContext", {})
    security = [c.get("securityContext", {}) for c in containers]
    # baseline: no host namespace, hostPath, hostPort, privileged container, added
    # capability outside its default set, or seccomp Unconfined.
    if any(pod.get(key) for key in HOST_NAMESPACES) or any("hostPath" in v for v in pod.get("volumes", [])):
        return "privileged"
    if any(s.get("privileged") for s in security) or any("hostPort" in p for c in containers for p in c.get("ports", [])):
        return "privileged"
    if any(set(s.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES for s in security):
        return "privileged"
    seccomp = [s.get("seccompProfile", pod_security.get("seccompProfile", {})).get("type") for s in security]
    if "Unconfined" in seccomp:
        return "privileged"
    # restricted: besides, only the volume types above, no privilege escalation, not
    # root, seccomp set, every capability dropped (NET_BIND_SERVICE alone may be added).
    if any(set(v) - {"name"} - RESTRICTED_VOLUMES for v in pod.get("volumes", [])):
        return "baseline"
    if not all(s.get("allowPrivilegeEscalation") is False for s in security):
        return "baseline"
    if not all(s.get("runAsNonRoot", pod_security.get("runAsNonRoot")) is True for s in security):
        return "baseline"
    if any(s.get("runAsUser", pod_security.get("runAsUser")) == 0 for s in security):
        return "baseline"
    if not all(kind in ("RuntimeDefault", "Localhost") for kind in seccomp):
        return "baseline"
    for s in security:
        caps = s.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            return "baseline"
    return "restricted"


BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP",
    "SETUID", "SYS_CHROOT",
}  # fmt: skip


def test_every_manifest_parses_and_names_what_it_must() -> None:
    assert {p.name for p in MANIFESTS} == {"gpumemd.yaml", "engine-pod.yaml", "engine-pod-dra.yaml"}
    docs = _documents()
    assert docs
    for path, doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path.name}: a document without apiVersion or kind"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), f"{path.name}: {doc['metadata']}"
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], f"{path.name}: {doc['kind']} is cluster-scoped"
        else:
            namespace = DRA_NAMESPACE if path.name == "engine-pod-dra.yaml" else NAMESPACE
            assert doc["metadata"].get("namespace") == namespace, f"{path.name}: {doc['kind']} outside namespace {namespace}"


def _schema_versions(doc: dict[str, Any]) -> tuple[str, str]:
    dra = doc["apiVersion"].startswith("resource.k8s.io/") or "resourceClaims" in doc.get("spec", {})
    return (OLDEST_DRA if dra else OLDEST), NEWEST


@pytest.mark.parametrize("path,doc", [(p, d) for p, d in _documents()], ids=lambda x: getattr(x, "name", None) or f"{x['kind']}/{x['metadata']['name']}")
def test_every_object_validates_against_the_kubernetes_schemas_offline(path: Path, doc: dict[str, Any]) -> None:
    """kubernetes-validate ships the API's JSON schemas for each release: no cluster, no
    network. Strict: a field the API does not know (a typo, a field from a newer release)
    fails, as the API server would refuse it."""
    for version in _schema_versions(doc):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']} against Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_the_schema_check_can_fail() -> None:
    """What the test above relies on: a misspelt field and a field an older release lacks
    are refused, and the resource.k8s.io kinds have schemas to be checked against."""
    (template,) = [d for _, d in _documents() if d["kind"] == "ResourceClaimTemplate"]
    wrong = copy.deepcopy(template)
    wrong["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"request": {"memory": "40Gi"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, NEWEST, strict=True)
    pod = next(d for _, d in _documents() if d["kind"] == "Pod" and "resourceClaims" in d["spec"])
    with pytest.raises(kubernetes_validate.ValidationError):  # 1.30's resourceClaims had "source"
        kubernetes_validate.validate(pod, OLDEST, strict=True)


def test_each_namespace_is_labelled_for_the_level_its_pods_need() -> None:
    namespaces = {doc["metadata"]["name"]: doc for _, doc in _documents() if doc["kind"] == "Namespace"}
    assert set(namespaces) == {NAMESPACE, DRA_NAMESPACE}
    order = ["restricted", "baseline", "privileged"]
    for name, namespace in namespaces.items():
        labels = namespace["metadata"].get("labels", {})
        pods = [pod for pod_name, pod in _pods() if _namespace_of(pod_name) == name]
        assert pods, f"namespace {name} holds no pod"
        needed = max((_level_needed(pod) for pod in pods), key=order.index)
        got = labels.get(PSA_ENFORCE)
        assert got == needed, f"the pods of namespace {name} need Pod Security {needed!r}; it says {got!r}"
        assert labels.get(f"{PSA_ENFORCE}-version"), f"{name}: the level's version is pinned or 'latest', not left to the cluster's default"


def _dra_pod() -> dict[str, Any]:
    return dict(_pods())["Pod/gpumem-dra-smoke"]


def test_the_dra_engine_pod_is_restricted() -> None:
    """The engine pod that reaches gpumemd through its claim needs nothing "restricted"
    refuses: pinned here, so that a hostPath or a host namespace added to it fails this
    rather than relabelling its namespace."""
    pod = _dra_pod()
    assert _level_needed(pod) == "restricted"
    assert not any(pod.get(key) for key in HOST_NAMESPACES)
    assert not any("hostPath" in v for v in pod.get("volumes", []))
    assert _namespace_of("Pod/gpumem-dra-smoke") == DRA_NAMESPACE


def _dra_kit() -> ModuleType:
    """tests/integration/dra_kit.py, the driver's part as the integration tests play it."""
    spec = importlib.util.spec_from_file_location("dra_kit", TESTS / "integration" / "dra_kit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dra_engine_pod_reads_what_the_fixtures_driver_gives_it() -> None:
    """The manifest and dra_kit agree on the contract: the engine takes the runtime
    directory and the token file from the environment the claim's CDI edits set (not from
    its own env or volumes), and the header says where the claim's directory appears."""
    kit = _dra_kit()
    (container,) = _dra_pod()["containers"]
    assert {e["name"] for e in container.get("env", [])} & {kit.ENV_RUNTIME_DIR, kit.ENV_TOKEN_FILE} == set(), "the driver sets them"
    assert not container.get("volumeMounts")
    script = " ".join(container["command"])
    assert f'runtime_dir=os.environ["{kit.ENV_RUNTIME_DIR}"]' in script
    assert f'tenant_token_file=os.environ["{kit.ENV_TOKEN_FILE}"]' in script
    assert [c["name"] for c in container["resources"]["claims"]] == [c["name"] for c in _dra_pod()["resourceClaims"]]
    header = (DEPLOY / "engine-pod-dra.yaml").read_text()
    assert f"{kit.ENV_TOKEN_FILE}={kit.CLAIM_MOUNT}/{kit.TOKEN_FILE}" in header
    assert f"{kit.ENV_RUNTIME_DIR}={kit.RUNTIME_MOUNT}" in header


@pytest.mark.parametrize(
    "change",
    [
        lambda pod: pod.setdefault("volumes", []).append({"name": "runtime", "hostPath": {"path": "/run/gpumemd"}}),
        lambda pod: pod.update(hostPID=True),
        lambda pod: pod.update(hostIPC=True),
        lambda pod: pod.update(hostNetwork=True),
        lambda pod: pod["containers"][0]["securityContext"].update(privileged=True),
        lambda pod: pod["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
        lambda pod: pod["containers"][0]["securityContext"].update(capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
        lambda pod: pod["containers"][0]["securityContext"].update(capabilities={}),
        lambda pod: [s.pop("runAsNonRoot") for s in (pod["securityContext"], pod["containers"][0]["securityContext"])],
        lambda pod: pod["securityContext"].update(runAsUser=0),
        lambda pod: pod["securityContext"].pop("seccompProfile"),
        lambda pod: pod["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
    ],
    ids=["hostPath", "hostPID", "hostIPC", "hostNetwork", "privileged", "escalation", "capability", "no-drop", "root-allowed",
         "root", "no-seccomp", "hostPort"],
)
def test_what_restricted_refuses_takes_the_dra_pod_out_of_it(change: Any) -> None:
    """The level computed above can fail: each thing Pod Security "restricted" refuses,
    done to the DRA engine pod, puts it below "restricted"."""
    pod = copy.deepcopy(_dra_pod())
    change(pod)
    assert _level_needed(pod) != "restricted"


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
        # The DRA driver's claims on this container's GPU, and those alone, read-only.
        claims = _arg(container, "--tenant-claims")
        assert mounts[claims]["hostPath"]["path"] == f"/run/gpumemd-claims/gpu{device}", container["name"]
        assert next(m for m in container["volumeMounts"] if m["mountPath"] == claims).get("readOnly") is True
        assert "emptyDir" in mounts["/tmp"]  # scratch under the read-only root
        assert [p["containerPort"] for p in container["ports"]] == [int(_arg(container, "--metrics-port"))]
        # No hostPID for engines: a namespaced taker cannot open its releaser's CUDA IPC event.
        assert _arg(container, "--lease-ordering") == "memops", container["name"]
        for probe in ("startupProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[command.index("--device") + 1] == device, f"{container['name']}'s {probe} asks another GPU"
    assert len(set(devices)) == len(devices), "one container per GPU"
    groups = {int(_arg(c, "--socket-group")) for c in pod["containers"]}
    for name in ("Pod/gpumem-smoke", "Pod/gpumem-dra-smoke"):
        engine = docs[name]["spec"]
        assert groups <= set(engine["securityContext"]["supplementalGroups"]), f"{name} reaches the sockets by the socket group"
        assert engine["securityContext"].get("runAsNonRoot") is True and engine["securityContext"].get("runAsUser", 0) != 0
