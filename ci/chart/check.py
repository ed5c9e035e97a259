#!/usr/bin/env python3
"""Checks of charts/outboxd, offline: Helm lint, rendering of every value set, strict
Kubernetes schema validation, cross-object wiring, rejection of bad values, and a runtime
test that runs the real binary exactly as the rendered pod would (command, args, env with
secrets resolved, user) against a real PostgreSQL and probes it where the chart points.

Run by ci/chart/check.sh, which provides the venv, the binary and the PostgreSQL cluster.
Prints one line per check and ends with `chart: N passed, M failed[, K skipped]`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # the mTLS rejection test is expected to fail a handshake

import grpc  # noqa: E402
import helm_python as helm
import kubernetes_validate.utils as kv
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helm_python import _native

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CHART = ROOT / "charts" / "outboxd"
RELEASE = "ci"
NAMESPACE = "outboxd-ci"
# Oldest supported (grpc probes GA), a common one, and the newest the validator knows.
KUBE_VERSIONS = ["1.27.0", "1.30.0", kv.latest_version()]
# What a cluster with prometheus-operator serves (`helm template --api-versions`).
MONITORING_API = ["monitoring.coreos.com/v1", "monitoring.coreos.com/v1/ServiceMonitor"]
# Kinds the validator has no schema for (CRDs); checked structurally instead.
CRD_KINDS = {"ServiceMonitor"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ---------------------------------------------------------------------------------------
# Bookkeeping


class Results:
    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.skipped: list[tuple[str, str]] = []

    def run(self, name: str, fn, *a, **kw):
        """Runs one check: an AssertionError (or any exception) fails it, Skip skips it."""
        try:
            out = fn(*a, **kw)
        except Skip as e:
            self.skipped.append((name, str(e)))
            print(f"SKIP {name}: {e}", flush=True)
            return None
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
            detail = str(e) if isinstance(e, AssertionError) else traceback.format_exc()
            self.failed.append((name, detail))
            print(f"FAIL {name}\n     {detail.strip().replace(chr(10), chr(10) + '     ')}", flush=True)
            return None
        self.passed.append(name)
        print(f"ok   {name}", flush=True)
        return out


class Skip(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ---------------------------------------------------------------------------------------
# Rendering


def load_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def header(path: Path, key: str) -> str | None:
    """`# key: value` from a values file's leading comment lines."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        m = re.match(rf"#\s*{re.escape(key)}:\s*(.*)$", line)
        if m:
            return m.group(1).strip()
    return None


def render(chart: helm.Chart, values: dict, api_versions=(), kube_version="v1.30.0", release=RELEASE):
    """Renders like `helm template RELEASE --api-versions … --kube-version …` (the SDK's C
    options; the Python wrapper does not expose them). Returns (documents, NOTES.txt)."""
    opts = {
        "name": release,
        "namespace": NAMESPACE,
        "is_install": True,
        "kube_version": kube_version,
        "api_versions": list(api_versions),
    }
    out = json.loads(
        _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts))
    )
    docs, notes = [], ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("namespace", NAMESPACE)
                docs.append(doc)
    return docs, notes


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind):
    found = by_kind(docs, kind)
    check(len(found) == 1, f"expected one {kind}, got {len(found)}")
    return found[0]


def pod_specs(docs):
    """(owner, pod spec, pod labels) of the Deployment and the Job."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            t = d["spec"]["template"]
            out.append((f"{d['kind']}/{d['metadata']['name']}", t["spec"], t["metadata"].get("labels", {})))
    return out


def service_link_variables(services) -> list[str]:
    """The variables the kubelet injects into every container of a pod with service links on
    (pkg/kubelet/envvars): per Service with a cluster IP (headless ones have none), its name
    upper-cased with `-` as `_`, then _SERVICE_HOST, _SERVICE_PORT[_<PORT NAME>] and the
    Docker-link _PORT, _PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]."""
    names = []
    for svc in services:
        if svc["spec"].get("clusterIP") == "None":
            continue
        prefix = svc["metadata"]["name"].upper().replace("-", "_")
        ports = svc["spec"]["ports"]
        names += [f"{prefix}_SERVICE_HOST", f"{prefix}_SERVICE_PORT", f"{prefix}_PORT"]
        for p in ports:
            if p.get("name"):
                names.append(f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}")
            port = f"{prefix}_PORT_{p['port']}_{p.get('protocol', 'TCP').upper()}"
            names += [port, f"{port}_PROTO", f"{port}_PORT", f"{port}_ADDR"]
    return names


def server_container(deployment):
    containers = deployment["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["name"] == "outboxd"]
    check(len(found) == 1, "the Deployment has no container named outboxd")
    return found[0]


def env_map(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def subset(small: dict, big: dict) -> bool:
    return all(big.get(k) == v for k, v in small.items())


# ---------------------------------------------------------------------------------------
# Checks on rendered manifests


def validate_k8s(docs, min_version=None):
    """Strict schema validation of every object against several Kubernetes versions (those
    from `min_version` on, for value sets using newer fields)."""
    def minor(v):
        return tuple(int(x) for x in v.split(".")[:2])
    min_version = min_version.split()[0] if min_version else None
    versions = [v for v in KUBE_VERSIONS if not min_version or minor(v) >= minor(min_version)]
    versions = versions or [min_version]
    checked = []
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        for version in versions:
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                raise AssertionError(
                    f"{d['kind']}/{d['metadata']['name']} invalid for Kubernetes {version}: {path}: {e.message}"
                ) from None
        checked.append(f"{d['kind']}/{d['metadata']['name']}")
    return checked


def check_wiring(docs, image, binary):
    """Cross-object consistency that schemas cannot see."""
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    check(subset(selector, pod_labels), "Deployment selector does not match its pod labels")
    server = server_container(deployment)
    port_names = {p["name"]: p["containerPort"] for p in server.get("ports", [])}
    check("grpc" in port_names, "server container has no port named grpc")
    job_labels = [labels for owner, _, labels in pod_specs(docs) if owner.startswith("Job/")]

    for d in docs:
        name = d["metadata"]["name"]
        check(len(name) <= 63 and DNS_LABEL.match(name), f"{d['kind']} name {name!r} is not a DNS label")

    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        check(subset(sel, pod_labels), f"Service {svc['metadata']['name']} selects no server pod")
        for labels in job_labels:
            check(not subset(sel, labels), f"Service {svc['metadata']['name']} would route to the migration Job")
        for p in svc["spec"]["ports"]:
            tp = p["targetPort"]
            check(
                tp in port_names if isinstance(tp, str) else tp in port_names.values(),
                f"Service port {p['name']} targets {tp!r}, not a container port",
            )
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        check(pdb["spec"]["selector"]["matchLabels"] == selector, "PDB selector differs from the Deployment's")
    for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        check(ref["kind"] == "Deployment" and ref["name"] == deployment["metadata"]["name"], "HPA targets something else")
        check("replicas" not in deployment["spec"], "Deployment sets replicas while an HPA scales it")
    for np in by_kind(docs, "NetworkPolicy"):
        check(np["spec"]["podSelector"]["matchLabels"] == selector, "NetworkPolicy selects other pods")
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                check(p["port"] in port_names, f"NetworkPolicy names unknown port {p['port']!r}")
    for sm in by_kind(docs, "ServiceMonitor"):
        services = by_kind(docs, "Service")
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if subset(sel, s["metadata"]["labels"])]
        check(matched, "ServiceMonitor selects no Service")
        for ep in sm["spec"]["endpoints"]:
            for s in matched:
                # A ServiceMonitor also matches the headless Service; that one has no metrics port.
                if s["spec"].get("clusterIP") == "None":
                    continue
                check(ep["port"] in {p["name"] for p in s["spec"]["ports"]}, f"ServiceMonitor port {ep['port']} not on Service")
        check(sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE], "ServiceMonitor watches another namespace")

    constraints = pod["spec"].get("topologySpreadConstraints", [])
    pairs = [(c["topologyKey"], c["whenUnsatisfiable"]) for c in constraints]
    # The API server refuses two constraints of one topologyKey and whenUnsatisfiable.
    check(len(pairs) == len(set(pairs)), f"duplicate topology spread constraints {pairs}")
    for c in constraints:
        check(subset(c.get("labelSelector", {}).get("matchLabels", {}), pod_labels),
              f"topology spread constraint over {c['topologyKey']} does not count the server pods")

    for owner, spec, _ in pod_specs(docs):
        check(spec.get("automountServiceAccountToken") is False, f"{owner} mounts an API token")
        # A Service named outbox or outbox-* in the namespace would otherwise inject
        # OUTBOX_*_SERVICE_HOST and the like (outboxd ignores them; the pod needs only DNS).
        check(spec.get("enableServiceLinks") is False, f"{owner} does not set enableServiceLinks: false")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        psc = spec.get("securityContext", {})
        ours = [c for c in spec.get("initContainers", []) + spec["containers"] if c["image"] == image]
        check(ours, f"{owner} runs no outboxd container")
        for c in ours:
            where = f"{owner} container {c['name']}"
            sc = c.get("securityContext", {})
            check(sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, f"{where}: runAsNonRoot")
            check(sc.get("runAsUser", psc.get("runAsUser", 1)) != 0, f"{where}: runs as root")
            check(sc.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem writable")
            check(sc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed")
            check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{where}: capabilities not dropped")
            seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
            check(seccomp == "RuntimeDefault", f"{where}: seccomp {seccomp}")
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                check(m["name"] in volumes, f"{where}: mount {m['name']} has no volume")
            check("/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]["name"]], f"{where}: no writable /tmp")
            names = [e["name"] for e in c.get("env", [])]
            check(len(names) == len(set(names)), f"{where}: duplicate env {names}")
            env = env_map(c)
            url = env.get("OUTBOX_DATABASE__URL", {})
            check("secretKeyRef" in url.get("valueFrom", {}), f"{where}: database URL not from a Secret")
            fleet = env.get("OUTBOX_DATABASE__FLEET_URL", {})
            check("secretKeyRef" in fleet.get("valueFrom", {}), f"{where}: fleet URL not from a Secret")
            unknown = binary.unknown([n for n in names if n.startswith("OUTBOX_")])
            check(not unknown, f"{where}: this outboxd refuses {unknown} as unknown variables")
            # Every file path handed to outboxd must be a key of a mounted Secret.
            for n in ("OUTBOX_TLS__CERT_FILE", "OUTBOX_TLS__KEY_FILE", "OUTBOX_TLS__CLIENT_CA_FILE"):
                if n in env:
                    path = env[n]["value"]
                    # The deepest mount holding the path, as in the container.
                    mount = sorted((m for p, m in mounts.items() if path.startswith(p.rstrip("/") + "/")),
                                   key=lambda m: -len(m["mountPath"]))
                    check(mount, f"{where}: {n}={path} is not under a mount")
                    vol = volumes[mount[0]["name"]]
                    rel = path[len(mount[0]["mountPath"].rstrip("/")) + 1:]
                    items = [i["path"] for i in vol.get("secret", {}).get("items", [])]
                    check(rel in items, f"{where}: {n}={path}: the Secret volume has no item {rel}")
        for c in spec["containers"]:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if not probe:
                    continue
                if "grpc" in probe:
                    check(probe["grpc"]["port"] in port_names.values(), f"{kind} gRPC port is not a container port")
                elif "httpGet" in probe:
                    check(probe["httpGet"]["port"] in port_names, f"{kind} HTTP port is not a named container port")
                elif "tcpSocket" in probe:
                    check(probe["tcpSocket"]["port"] in port_names, f"{kind} TCP port is not a named container port")
    return deployment


# Expectations per value set, on top of the generic checks.


def expect_default(docs, notes):
    kinds = sorted(d["kind"] for d in docs)
    check(kinds == ["Deployment", "Job", "PodDisruptionBudget", "Service", "ServiceAccount"], f"kinds {kinds}")
    server = server_container(one(docs, "Deployment"))
    check(server["args"] == ["serve"], f"server args {server['args']}")
    env = {n: e.get("value") for n, e in env_map(server).items()}
    check(env == {
        "OUTBOX_LISTEN_ADDR": "0.0.0.0:50051", "OUTBOX_DATABASE__URL": None,
        "OUTBOX_DATABASE__FLEET_URL": None, "OUTBOX_LOG__FORMAT": "json",
        "OUTBOX_ALLOW_PLAINTEXT": "true", "OUTBOX_METRICS__LISTEN_ADDR": "0.0.0.0:9464",
        "OUTBOX_SHUTDOWN__DRAIN_DELAY": "5s", "OUTBOX_SHUTDOWN__GRACE": "20s",
    }, f"server env {env}")
    check({p["name"] for p in one(docs, "Service")["spec"]["ports"]} == {"grpc", "metrics"}, "Service ports")
    check([p["name"] for p in server["ports"]] == ["grpc", "metrics"], f"container ports {server['ports']}")
    paths = {"startupProbe": "/livez", "readinessProbe": "/readyz", "livenessProbe": "/livez"}
    for kind, path in paths.items():
        check(server[kind].get("httpGet") == {"path": path, "port": "metrics"}, f"{kind} not GET {path} on the metrics port")
    job = one(docs, "Job")
    check(job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade", "Job is not a pre-install hook")
    check(job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"], "Job does not run migrate")
    check("serviceAccountName" not in job["spec"]["template"]["spec"], "hook Job uses the not-yet-created ServiceAccount")
    # Namespaces whose ResourceQuota requires requests admit the Job.
    requests = job["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("requests", {})
    check(requests == {"cpu": "50m", "memory": "64Mi"}, f"migrate container requests {requests}")
    # The two default replicas prefer different nodes, and only prefer.
    spread = one(docs, "Deployment")["spec"]["template"]["spec"].get("topologySpreadConstraints")
    check(spread == [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                      "labelSelector": {"matchLabels": one(docs, "Deployment")["spec"]["selector"]["matchLabels"]}}],
          f"default topology spread {spread}")
    owner = env_map(job["spec"]["template"]["spec"]["containers"][0])["OUTBOX_DATABASE__MIGRATION_URL"]
    check(owner["valueFrom"]["secretKeyRef"] == {"name": "ci-outboxd-database-owner", "key": "url"}, f"owner URL {owner}")
    check("OUTBOX_DATABASE__MIGRATION_URL" not in env, "the server got the owner's URL")
    fleet = env_map(server)["OUTBOX_DATABASE__FLEET_URL"]
    check(fleet["valueFrom"]["secretKeyRef"] == {"name": "ci-outboxd-database-fleet", "key": "url"}, f"fleet URL {fleet}")
    # NOTES come after the install, whose pre-install Job needed the Secrets: they name them
    # as a check, never as a step still to take.
    secrets = "ci-outboxd-database ci-outboxd-database-fleet ci-outboxd-database-owner"
    check(f"kubectl -n outboxd-ci get secret {secrets}\n" in notes, "NOTES do not list the Secrets to check")
    check("before `helm install`" in notes, "NOTES do not say the Secrets come before the install")
    check(not re.search(r"create secret generic ci-outboxd-database", notes), "NOTES ask for a database Secret after the install")
    # The migration step grants; no SQL is left to the operator.
    check("grant_service_role" not in notes and "GRANT outboxd_fleet" not in notes, "NOTES still ask for a grant by hand")
    check("no SQL to run by hand" in notes, "NOTES do not say the migration step grants")
    # No key yet: the recipe for a first one.
    check("apiKeys.keys[0].existingSecret=ci-outboxd-api-key" in notes and "openssl rand -hex 32" in notes,
          "NOTES lack the first API key's recipe")
    check(not [d for d in by_kind(docs, "Job") if d["metadata"]["name"].endswith("-api-keys")], "a key Job without keys")


def expect_tls(docs, notes):
    server = server_container(one(docs, "Deployment"))
    env = env_map(server)
    check(env["OUTBOX_TLS__CERT_FILE"]["value"] == "/etc/outboxd/tls/tls.crt", "cert path")
    check(env["OUTBOX_TLS__KEY_FILE"]["value"] == "/etc/outboxd/tls/tls.key", "key path")
    check(env["OUTBOX_TLS__CLIENT_CA_FILE"]["value"] == "/etc/outboxd/client-ca/ca.crt", "client CA path")
    check("OUTBOX_ALLOW_PLAINTEXT" not in env, "plaintext opt-in set with TLS")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        check("httpGet" in server[kind], f"{kind} should stay HTTP on the plaintext metrics port with TLS")
    svc = one(docs, "Service")
    check("appProtocol" not in svc["spec"]["ports"][0], "h2c appProtocol on a TLS port")
    check("https" in notes, "NOTES do not mention https")
    # The buf curl line trusts the server's CA, names a host of its certificate (not the
    # forwarded 127.0.0.1) and, with mTLS, presents a client certificate.
    buf = re.search(r"buf curl .*", notes.replace("\\\n", " ")).group(0)
    for flag in ("--cacert ca.crt", "--cert client.crt", "--key client.key", "--servername ci-outboxd.outboxd-ci.svc", "https://127.0.0.1:50051/"):
        check(flag in " ".join(buf.split()), f"NOTES' buf curl lacks {flag}: {buf}")
    check("jsonpath='{.data.ca\\.crt}'" in notes, "NOTES do not say where ca.crt comes from")
    # outboxd reads the certificate files again when they change: NOTES say so.
    check("again when the mounted files change" in notes and "without a restart" in notes,
          "NOTES do not say a renewed certificate is served without a restart")


def expect_metrics_off(docs, notes):
    env = env_map(server_container(one(docs, "Deployment")))
    check(env["OUTBOX_METRICS__LISTEN_ADDR"]["value"] == "", "metrics not turned off")
    check([p["name"] for p in one(docs, "Service")["spec"]["ports"]] == ["grpc"], "Service still has a metrics port")
    server = server_container(one(docs, "Deployment"))
    check(server["readinessProbe"].get("grpc", {}).get("port") == 50051, "readiness should fall back to gRPC health without the admin port")
    check(server["readinessProbe"]["grpc"]["service"] == "outbox.v1.OutboxService", "readiness checks another service")
    # The whole server's gRPC health turns NOT_SERVING without the database: a liveness
    # probe on it would restart every pod during an outage.
    for kind in ("startupProbe", "livenessProbe"):
        check(server[kind].get("tcpSocket", {}).get("port") == "grpc", f"{kind} should connect over TCP without the admin port: {server[kind]}")


def expect_console(docs, notes):
    """console.enabled: the address on every outboxd container (one configuration), a
    `console` port on the pod, the Service and the NetworkPolicy; NOTES say how to open it."""
    deployment = one(docs, "Deployment")
    server = server_container(deployment)
    env = env_map(server)
    check(env["OUTBOX_CONSOLE__LISTEN_ADDR"]["value"] == "0.0.0.0:8081", f"console address {env.get('OUTBOX_CONSOLE__LISTEN_ADDR')}")
    check(env["OUTBOX_CONSOLE__SESSION_TTL"]["value"] == "1h", "session TTL from env")
    check(env["OUTBOX_METRICS__LISTEN_ADDR"]["value"] == "0.0.0.0:9464", "metrics address changed by the console")
    migrate = one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]
    check(env_map(migrate)["OUTBOX_CONSOLE__LISTEN_ADDR"]["value"] == "0.0.0.0:8081", "migrate sees another configuration")
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    check(ports == {"grpc": 50051, "metrics": 9464, "console": 8081}, f"container ports {ports}")
    svc_ports = {p["name"]: (p["port"], p["targetPort"]) for p in one(docs, "Service")["spec"]["ports"]}
    check(svc_ports == {"grpc": (50051, "grpc"), "metrics": (9464, "metrics"), "console": (8081, "console")},
          f"Service ports {svc_ports}")
    rules = one(docs, "NetworkPolicy")["spec"]["ingress"]
    console = [r for r in rules if [p["port"] for p in r["ports"]] == ["console"]]
    check(len(rules) == 3 and len(console) == 1, f"NetworkPolicy should open grpc, metrics and console: {rules}")
    check(console[0]["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "operators"}}}],
          "networkPolicy.consoleFrom ignored")
    check("port-forward svc/ci-outboxd 8081:8081" in notes and "http://127.0.0.1:8081/" in notes,
          "NOTES do not say how to open the console")
    check("and so is the\nconsole, whose sign-in sends an API key. Reach them" in notes, "NOTES do not warn the console is plaintext")


def expect_hook(docs, notes):
    job = one(docs, "Job")
    spec = job["spec"]["template"]["spec"]
    check(spec["serviceAccountName"] == "outboxd-existing", f"Job SA {spec.get('serviceAccountName')}")
    check(not by_kind(docs, "ServiceAccount"), "ServiceAccount created although create=false")
    migrate_env = env_map(spec["containers"][0])
    check("OUTBOX_DATABASE__MIGRATION_URL" in migrate_env, "migration URL missing on the Job")
    server_env = env_map(server_container(one(docs, "Deployment")))
    check("OUTBOX_DATABASE__MIGRATION_URL" not in server_env, "the server got the owner's URL")
    check("initContainers" not in one(docs, "Deployment")["spec"]["template"]["spec"], "init containers in hook mode")


def expect_init_container(docs, notes):
    check(not by_kind(docs, "Job"), "a Job in initContainer mode")
    inits = one(docs, "Deployment")["spec"]["template"]["spec"]["initContainers"]
    check([c["name"] for c in inits] == ["db-proxy", "migrate"], f"init order {[c['name'] for c in inits]}")
    check(inits[1]["args"] == ["migrate"], "init container does not run migrate")


def expect_none(docs, notes):
    check(not by_kind(docs, "Job"), "a Job in none mode")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    check("initContainers" not in pod, "init containers in none mode")
    check("OUTBOX_DATABASE__MIGRATION_URL" in env_map(server_container(one(docs, "Deployment"))), "server lacks the owner URL in none mode")


def expect_autoscaling(docs, notes):
    hpa = one(docs, "HorizontalPodAutoscaler")
    check(hpa["apiVersion"] == "autoscaling/v2", hpa["apiVersion"])
    names = sorted(m["resource"]["name"] for m in hpa["spec"]["metrics"])
    check(names == ["cpu", "memory"], f"metrics {names}")
    one(docs, "PodDisruptionBudget")


def expect_autoscaling_from_one(docs, notes):
    one(docs, "HorizontalPodAutoscaler")
    check(not by_kind(docs, "PodDisruptionBudget"), "a PDB over what may be a single pod blocks node drains")


def expect_service_monitor(docs, notes):
    sm = one(docs, "ServiceMonitor")
    check(sm["apiVersion"] == "monitoring.coreos.com/v1", sm["apiVersion"])
    check(sm["metadata"]["labels"].get("release") == "kube-prometheus-stack", "extra labels missing")
    env = env_map(server_container(one(docs, "Deployment")))
    check(env["OUTBOX_METRICS__LISTEN_ADDR"]["value"] == "0.0.0.0:9464", "metrics address")
    check({p["name"] for p in one(docs, "Service")["spec"]["ports"]} == {"grpc", "metrics"}, "Service ports")
    np = one(docs, "NetworkPolicy")
    check(len(np["spec"]["ingress"]) == 2, "NetworkPolicy should open grpc and metrics")


def expect_kitchen_sink(docs, notes):
    d = one(docs, "Deployment")
    server = server_container(d)
    check(server["image"] == "registry.example.com/outboxd:0.1.0@sha256:" + "0123456789abcdef" * 4, server["image"])
    check(d["metadata"]["name"] == "outbox", "fullnameOverride ignored")
    env = env_map(server)
    check(env["OUTBOX_LEASE__DEFAULT"]["value"] == "45s", "env value")
    check(env["OUTBOX_LIMITS__MAX_BATCH"]["value"] == "500", "numeric env value not quoted")
    check(env["OUTBOX_LIMITS__MAX_MESSAGE_BYTES"]["value"] == "16777216", f"a large number as text: {env['OUTBOX_LIMITS__MAX_MESSAGE_BYTES']}")
    check(env["OUTBOX_DATABASE__MAX_CONNECTIONS"]["value"] == "8", "maxConnections")
    check(env["OUTBOX_LOG__FILTER"]["value"] == "info,outboxd=debug", "log filter")
    check("RUST_BACKTRACE" in env, "extraEnv")
    check([s["metadata"]["name"] for s in by_kind(docs, "Service")] == ["outbox", "outbox-headless"], "headless Service")
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    check(pdb.get("maxUnavailable") == "50%" and "minAvailable" not in pdb, f"PDB {pdb}")
    check(server["lifecycle"]["preStop"]["sleep"]["seconds"] == 5, "lifecycle")
    check([c["name"] for c in d["spec"]["template"]["spec"]["containers"]] == ["outboxd", "log-shipper"], "extraContainers")
    check(d["metadata"].get("annotations") == {"secret.reloader.stakater.com/reload": "outbox-tls"},
          f"deploymentAnnotations: {d['metadata'].get('annotations')}")
    check("secret.reloader.stakater.com/reload" not in d["spec"]["template"]["metadata"].get("annotations", {}),
          "deploymentAnnotations reached the pods")
    # The user's zone spread, and the chart's node spread (no user constraint over nodes).
    keys = [c["topologyKey"] for c in d["spec"]["template"]["spec"]["topologySpreadConstraints"]]
    check(keys == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"], f"topology spread over {keys}")
    # The pod extras reach the hook Job's pod, not the extra containers (which would never end).
    job = one(docs, "Job")["spec"]["template"]
    check(job["metadata"]["annotations"] == {"example.com/team": "payments"}, f"Job pod annotations {job['metadata']}")
    check(job["metadata"]["labels"].get("example.com/tier") == "backend", "podLabels not on the Job's pod")
    check([c["name"] for c in job["spec"]["containers"]] == ["migrate"], "extraContainers in the Job")


def expect_api_keys(docs, notes):
    """An install renders the key bootstrap: a post-install/post-upgrade Job storing each
    key of apiKeys.keys from its Secret as the schema owner, and NOTES saying how to use one."""
    job = one([d for d in by_kind(docs, "Job") if d["metadata"]["name"].endswith("-api-keys")], "Job")
    meta = job["metadata"]
    check(meta["name"] == "ci-outboxd-api-keys", meta["name"])
    check(meta["annotations"]["helm.sh/hook"] == "post-install,post-upgrade", "the key Job is not a post-install/post-upgrade hook")
    check(job["spec"]["backoffLimit"] == 10, "apiKeys.job.backoffLimit ignored")
    pod = job["spec"]["template"]["spec"]
    check(pod["serviceAccountName"] == "ci-outboxd", "the key Job runs as another ServiceAccount")
    check(pod["restartPolicy"] == "Never", pod["restartPolicy"])
    first, second = pod["containers"]
    check(first["args"] == ["keys", "create", "--name", "bootstrap", "--scope", "admin", "--all-tenants",
                            "--secret-from-env", "API_KEY"], f"first key args {first['args']}")
    check(second["args"] == ["keys", "create", "--name", "billing", "--scope", "produce", "--scope", "consume",
                             "--tenant", "acme", "--tenant", "globex", "--region", "eu-west",
                             "--secret-from-env", "API_KEY"], f"second key args {second['args']}")
    for c, ref in ((first, {"name": "outboxd-api-key", "key": "api-key"}), (second, {"name": "billing-keys", "key": "producer"})):
        env = env_map(c)
        check(env["API_KEY"]["valueFrom"]["secretKeyRef"] == ref, f"{c['name']} key from {env['API_KEY']}")
        owner = env["OUTBOX_DATABASE__MIGRATION_URL"]["valueFrom"]["secretKeyRef"]
        check(owner == {"name": "ci-outboxd-database-owner", "key": "url"}, f"{c['name']} owner URL {owner}")
    # The server never holds the owner's URL nor a key.
    server_env = env_map(server_container(one(docs, "Deployment")))
    check("API_KEY" not in server_env and "OUTBOX_DATABASE__MIGRATION_URL" not in server_env, "the server got a key or the owner's URL")
    check("outboxd-api-key billing-keys\n" in notes, "NOTES do not list the key Secrets")
    check("ci-outboxd-api-keys stored" in notes and "get secret outboxd-api-key" in notes, "NOTES do not say how to use a key")
    check("openssl rand" not in notes, "NOTES offer a first key although keys are set")


def expect_jobs_pod_extras(docs, notes):
    """The migration and key Jobs' pods get what the server's get to reach PostgreSQL (the
    native sidecar proxy of extraInitContainers, podAnnotations, podLabels), each Job's own
    podAnnotations and podLabels over them, and keep their own component label (wiring
    checks that no Service selects them)."""
    deployment = one(docs, "Deployment")
    jobs = {j["metadata"]["name"]: j["spec"]["template"] for j in by_kind(docs, "Job")}
    check(sorted(jobs) == ["ci-outboxd-api-keys", "ci-outboxd-migrate"], f"Jobs {sorted(jobs)}")
    pods = {"server": deployment["spec"]["template"], "migrate": jobs["ci-outboxd-migrate"],
            "api-keys": jobs["ci-outboxd-api-keys"]}
    for component, pod in pods.items():
        inits = pod["spec"].get("initContainers", [])
        check([c["name"] for c in inits][:1] == ["db-proxy"] and inits[0]["restartPolicy"] == "Always",
              f"{component}: no db-proxy native sidecar first: {[c['name'] for c in inits]}")
        labels = pod["metadata"]["labels"]
        check(labels["app.kubernetes.io/component"] == component, f"{component}: component label {labels}")
        check(labels["example.com/tier"] == "backend", f"{component}: podLabels missing: {labels}")
    annotations = {k: p["metadata"].get("annotations", {}) for k, p in pods.items()}
    check(annotations["server"] == {"example.com/team": "payments", "proxy.example.com/inject": "true"},
          f"server annotations {annotations['server']}")
    check(annotations["migrate"] == {"example.com/team": "payments", "proxy.example.com/inject": "true",
                                     "sidecar.istio.io/inject": "false"}, f"migrate annotations {annotations['migrate']}")
    check(annotations["api-keys"] == {"example.com/team": "payments", "proxy.example.com/inject": "false"},
          f"api-keys annotations {annotations['api-keys']}")
    check(pods["migrate"]["metadata"]["labels"].get("example.com/job") == "migrate", "migrations.job.podLabels")
    check("example.com/job" not in pods["server"]["metadata"]["labels"], "a Job's podLabels reached the server")
    # The Jobs' volumes hold what the sidecar mounts.
    for component, pod in pods.items():
        volumes = {v["name"] for v in pod["spec"]["volumes"]}
        check("proxy-config" in volumes, f"{component}: the sidecar's volume is missing")


def expect_single_replica(docs, notes):
    check(not by_kind(docs, "PodDisruptionBudget"), "a PDB on one replica blocks node drains")


EXPECTATIONS = {
    "default": expect_default,
    "tls.yaml": expect_tls,
    "metrics-off.yaml": expect_metrics_off,
    "console.yaml": expect_console,
    "migrations-hook.yaml": expect_hook,
    "migrations-initcontainer.yaml": expect_init_container,
    "migrations-none.yaml": expect_none,
    "autoscaling.yaml": expect_autoscaling,
    "autoscaling-from-one.yaml": expect_autoscaling_from_one,
    "servicemonitor.yaml": expect_service_monitor,
    "kitchen-sink.yaml": expect_kitchen_sink,
    "single-replica.yaml": expect_single_replica,
    "api-keys.yaml": expect_api_keys,
    "jobs-pod-extras.yaml": expect_jobs_pod_extras,
}


def undocumented_values(text: str) -> list[str]:
    """Keys of values.yaml with no `# --` comment on themselves or on an enclosing key.
    A key whose value is a section (nothing after the colon) is covered when every child
    is."""
    lines = text.splitlines()
    entries = []  # (indent, key, is_section, has_doc)
    comment_run: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment_run.append(stripped)
            continue
        m = re.match(r"^(\s*)([A-Za-z0-9_]+):\s*(.*)$", line)
        if m:
            entries.append((len(m.group(1)), m.group(2), m.group(3) == "", any(c.startswith("# --") for c in comment_run)))
        comment_run = []
    missing = []

    def walk(i: int, path: str) -> int:
        indent, key, section, doc = entries[i]
        full = f"{path}.{key}" if path else key
        j = i + 1
        children = []
        while j < len(entries) and entries[j][0] > indent:
            children.append(j)
            j = walk(j, full) if not doc else _skip(j)
        if not doc and (not section or not children):
            missing.append(full)
        return j

    def _skip(j: int) -> int:
        indent = entries[j][0]
        j += 1
        while j < len(entries) and entries[j][0] > indent:
            j += 1
        return j

    i = 0
    while i < len(entries):
        i = walk(i, "")
    return missing


def schema_drift(values: dict, schema: dict, path: str = "") -> list[str]:
    """Keys the schema defines that values.yaml lacks (so they have no documented default)."""
    out = []
    for key, sub in schema.get("properties", {}).items():
        full = f"{path}.{key}" if path else key
        if key == "global":
            continue
        if key not in values:
            out.append(full)
        elif isinstance(values[key], dict) and "properties" in sub:
            out.extend(schema_drift(values[key], sub, full))
    return out


# ---------------------------------------------------------------------------------------
# The binary


class Binary:
    """The outboxd under test, asked which OUTBOX_* variables it accepts."""

    def __init__(self, path: str):
        self.path = path
        self.version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.strip()
        self._unknown: dict[str, bool] = {}

    def unknown(self, names) -> list[str]:
        """Names this build refuses as unknown."""
        todo = [n for n in names if n not in self._unknown and n != "OUTBOX_LISTEN_ADDR"]
        if todo:
            text = self._configuration_errors({n: "x" for n in todo})
            for n in todo:
                # `NAME: unknown variable` (src/config/load.rs); `NAME="value": …` for a known
                # variable with a bad value.
                self._unknown[n] = bool(re.search(rf"^\s*{re.escape(n)}(=.*)?:\s*unknown variable", text, re.M))
        return sorted(n for n in names if self._unknown.get(n))

    def refused_service_links(self, names) -> list[str]:
        """Of the service-link variables `names`, with the values the kubelet gives them,
        those this build refuses."""
        text = self._configuration_errors({n: service_link_value(n) for n in names})
        return sorted(n for n in names if re.search(rf"^\s*{re.escape(n)}(=.*)?:", text, re.M))

    def _configuration_errors(self, variables: dict) -> str:
        """What this build says of `variables`. It reports every bad variable at once, and a
        bad listen address makes sure it stops at configuration (no database needed)."""
        env = {"PATH": os.environ.get("PATH", ""), **variables, "OUTBOX_LISTEN_ADDR": "not-an-address"}
        p = subprocess.run([self.path, "migrate"], env=env, capture_output=True, text=True, timeout=60)
        text = p.stdout + p.stderr
        check(p.returncode != 0 and "OUTBOX_LISTEN_ADDR" in text, f"unexpected configuration probe result: {text}")
        return text


def service_link_value(name: str) -> str:
    """What the kubelet sets `name` to (pkg/kubelet/envvars), for a cluster IP 10.96.0.12."""
    if name.endswith(("_SERVICE_HOST", "_ADDR")):
        return "10.96.0.12"
    if name.endswith("_PROTO"):
        return "tcp"
    if re.search(r"_SERVICE_PORT(_[A-Z0-9_]+)?$", name):
        return "50051"
    port = re.search(r"_PORT_(\d+)_[A-Z]+(_PORT)?$", name)
    if port and port.group(2):
        return port.group(1)
    if port or name.endswith("_PORT"):
        return f"tcp://10.96.0.12:{port.group(1) if port else 50051}"
    raise ValueError(f"not a service-link variable: {name}")


def image_runtime(dockerfile: Path):
    """ENTRYPOINT, CMD, ENV, USER of the Dockerfile's last stage (what the pod runs)."""
    stage = dockerfile.read_text().split("\nFROM ")[-1]
    entry = json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", stage, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD\s+(\[.*\])\s*$", stage, re.M).group(1))
    env = dict(re.findall(r"^ENV\s+([A-Z0-9_]+)=(\S+)\s*$", stage, re.M))
    user = re.search(r"^USER\s+(\S+)\s*$", stage, re.M).group(1)
    return entry, cmd, env, user


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pod:
    """Runs a rendered pod's containers as processes: the image's entrypoint mapped to the
    local binary, the container's args, its env with Secret references resolved, as its
    user, in a directory it cannot write (the root filesystem is read-only)."""

    def __init__(self, work: Path, binary: str, dockerfile: Path, secrets: dict, files: dict):
        self.work = work
        self.entry, self.cmd, self.image_env, self.image_user = image_runtime(dockerfile)
        check(self.entry == ["/usr/local/bin/outboxd"], f"ENTRYPOINT {self.entry}")
        # The binary at its image path under a private root, readable by the pod's user.
        root = work / "image"
        (root / "usr/local/bin").mkdir(parents=True, exist_ok=True)
        self.binary = root / "usr/local/bin/outboxd"
        if not self.binary.exists():
            shutil.copy2(binary, self.binary)
            self.binary.chmod(0o755)
        self.cwd = work / "cwd"
        self.cwd.mkdir(exist_ok=True)
        self.secrets = secrets
        self.files = files
        self.procs: list[subprocess.Popen] = []

    def env(self, container) -> dict:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", **self.image_env}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = str(e["value"])
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                key = (ref["name"], ref["key"])
                check(key in self.secrets, f"env {e['name']}: Secret {key} not provided by the test")
                env[e["name"]] = self.secrets[key]
            else:
                raise AssertionError(f"env {e['name']}: unsupported source {e}")
        return env

    def argv(self, container, spec) -> list[str]:
        command = container.get("command") or self.entry
        args = container.get("args", [] if container.get("command") else self.cmd)
        check(command == self.entry, f"container {container['name']} overrides the entrypoint: {command}")
        argv = [str(self.binary), *args]
        if os.geteuid() == 0:
            psc = spec.get("securityContext", {})
            sc = container.get("securityContext", {})
            uid = sc.get("runAsUser", psc.get("runAsUser"))
            gid = sc.get("runAsGroup", psc.get("runAsGroup", uid))
            check(uid is not None and uid != 0, "the pod would run as root")
            groups = [str(gid)] + ([str(psc["fsGroup"])] if "fsGroup" in psc else [])
            argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", f"--groups={','.join(groups)}",
                    "--inh-caps=-all", "--", *argv]
        return argv

    def materialize(self, container, spec):
        """Writes the test's Secret data where the pod's Secret volumes would mount it."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        psc = spec.get("securityContext", {})
        for m in container.get("volumeMounts", []):
            vol = volumes[m["name"]]
            if "secret" not in vol:
                continue
            target = Path(m["mountPath"])
            check(str(target).startswith(str(self.work)), f"mount {target} outside the test dir (set its mountPath value)")
            target.mkdir(parents=True, exist_ok=True)
            for item in vol["secret"].get("items", []):
                key = (vol["secret"]["secretName"], item["key"])
                check(key in self.files, f"Secret {key} not provided by the test")
                path = target / item["path"]
                path.write_bytes(self.files[key])
                path.chmod(vol["secret"].get("defaultMode", 0o644))
                if os.geteuid() == 0 and "fsGroup" in psc:
                    os.chown(path, 0, psc["fsGroup"])
            target.chmod(0o755)

    def run_to_completion(self, container, spec, timeout=120) -> str:
        self.materialize(container, spec)
        argv = self.argv(container, spec)
        p = subprocess.run(argv, env=self.env(container), cwd=self.cwd, capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
        check(p.returncode == 0, f"{shlex.join(argv)} exited {p.returncode}:\n{out}")
        return out

    def start(self, container, spec, log: Path) -> subprocess.Popen:
        self.materialize(container, spec)
        argv = self.argv(container, spec)
        fh = open(log, "wb")
        p = subprocess.Popen(argv, env=self.env(container), cwd=self.cwd, stdout=fh, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def stop_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def health(port: int, service: str, credentials=None, timeout: float = 2.0) -> str:
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", "localhost")]) \
        if credentials else grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def call_with_key(port: int, key: str) -> grpc.StatusCode:
    """GetQueueStats (an empty request) with `key` as the bearer; the call's status code."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/outbox.v1.OutboxService/GetQueueStats",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            call(b"", metadata=[("authorization", f"Bearer {key}")], timeout=5)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()


def probe_once(probe: dict, port_names: dict, credentials=None) -> str:
    """What kubelet would do for this probe, against 127.0.0.1."""
    timeout = probe.get("timeoutSeconds", 1)
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        port = port_names[port] if isinstance(port, str) else port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['httpGet']['path']}", timeout=timeout) as reply:
                return "SERVING" if 200 <= reply.status < 400 else f"HTTP {reply.status}"
        except urllib.error.HTTPError as e:
            return "NOT_SERVING" if e.code == 503 else f"HTTP {e.code}"
    if "grpc" in probe:
        return health(probe["grpc"]["port"], probe["grpc"].get("service", ""), None, timeout)
    if "tcpSocket" in probe:
        port = probe["tcpSocket"]["port"]
        port = port_names[port] if isinstance(port, str) else port
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            pass
        # A TCP probe passes on connect; show the TLS listener serves health too.
        return health(port, "", credentials, timeout) if credentials else "SERVING"
    raise AssertionError(f"unsupported probe {probe}")


# ---------------------------------------------------------------------------------------
# PostgreSQL (the cluster is started by check.sh; trust authentication)


class Postgres:
    def __init__(self, url: str, bindir: str):
        self.url = url.rstrip("/")
        self.bindir = bindir
        m = re.match(r"postgres(?:ql)?://([^@/]+)@([^:/]+):(\d+)", url)
        self.user, self.host, self.port = m.group(1), m.group(2), m.group(3)

    def psql(self, sql: str, db: str = "postgres") -> str:
        p = subprocess.run(
            [f"{self.bindir}/psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", self.host, "-p", self.port,
             "-U", self.user, "-d", db, "-c", sql],
            capture_output=True, text=True,
        )
        check(p.returncode == 0, f"psql {sql!r}: {p.stderr}")
        return p.stdout.strip()

    def fresh_database(self, name: str) -> str:
        self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.psql(f"CREATE DATABASE {name}")
        return name

    def url_for(self, user: str, db: str) -> str:
        return f"postgres://{user}@{self.host}:{self.port}/{db}"


# ---------------------------------------------------------------------------------------
# Runtime test


def runtime_test(args, chart, binary: Binary, pg: Postgres, mode: str, tls: bool = False, keys: bool = False):
    """Renders the chart with default values (`mode` picks migrations; `tls` adds TLS and
    mTLS; `keys` a key in apiKeys.keys), provides the Secrets it names, runs the migration
    container, then the server, probes it like kubelet, stores the key as the key Job does
    (twice: install, upgrade) and calls the server with it, scrapes its metrics and stops it
    like Kubernetes does."""
    work = Path(tempfile.mkdtemp(prefix=f"pod-{mode}-", dir=args.work))
    work.chmod(0o755)
    db = pg.fresh_database(f"outbox_chart_{mode.lower()}{'_tls' if tls else ''}")
    # The service role owns nothing and is no superuser (outboxd refuses one that could
    # bypass row-level security); the owner (here the cluster's superuser) migrates.
    # The fleet role: a login the owner makes a member of outboxd_fleet (which the first
    # migration creates) for the work of every tenant.
    role, fleet_role = "outboxd", "outboxd_fleet_login"
    for r in (role, fleet_role):
        pg.psql(f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{r}') "
                f"THEN CREATE ROLE {r} LOGIN; END IF; END $$")
    secrets = {
        ("ci-outboxd-database", "url"): pg.url_for(role, db),
        ("ci-outboxd-database-fleet", "url"): pg.url_for(fleet_role, db),
        ("ci-outboxd-database-owner", "url"): pg.url_for(pg.user, db),
    }
    values: dict = {}
    if mode != "hook":
        values["migrations"] = {"mode": mode}
    api_key = None
    if keys:
        # What the operator puts in the Secret: obx_ and 64 hex digits (openssl rand -hex 32).
        api_key = "obx_" + os.urandom(32).hex()
        secrets[("ci-api-key", "api-key")] = api_key
        values["apiKeys"] = {"keys": [{"name": "bootstrap", "existingSecret": "ci-api-key", "scopes": ["admin"], "allTenants": True}]}
    notes = []
    files = {}
    credentials = None
    if tls:
        files, credentials = make_tls(work / "tls-material")
        # Secret volumes mount under the test directory instead of /etc (a value, not a hack).
        values["tls"] = {
            "enabled": True, "existingSecret": "ci-tls", "mountPath": str(work / "etc/outboxd/tls"),
            "clientCA": {"enabled": True, "mountPath": str(work / "etc/outboxd/client-ca")},
        }
    defaults = chart.values
    for key, value, path in (("containerPort", defaults["containerPort"], ("containerPort",)),
                             ("metrics.port", defaults["metrics"]["port"], ("metrics", "port"))):
        if not port_free(value):
            port = free_port()
            target = values
            for k in path[:-1]:
                target = target.setdefault(k, {})
            target[path[-1]] = port
            notes.append(f"{value} busy on this machine: {key}={port}")

    docs, install_notes = render(chart, values)
    deployment = check_wiring(docs, image_of(docs), binary)
    spec = deployment["spec"]["template"]["spec"]
    server = server_container(deployment)
    port_names = {p["name"]: p["containerPort"] for p in server["ports"]}
    env = {e["name"]: e.get("value") for e in server["env"]}
    check(env["OUTBOX_LISTEN_ADDR"] == f"0.0.0.0:{port_names['grpc']}", f"listen address {env['OUTBOX_LISTEN_ADDR']} is not the grpc port")

    pod = Pod(work, binary.path, ROOT / "Dockerfile", secrets, files)
    results = {}
    try:
        # 1. Migrations, where the chart runs them.
        if mode == "hook":
            job = one(docs, "Job")
            jspec = job["spec"]["template"]["spec"]
            out = pod.run_to_completion(jspec["containers"][0], jspec)
            check("migrations applied" in out, f"hook Job output: {out}")
        elif mode == "initContainer":
            for c in spec.get("initContainers", []):
                out = pod.run_to_completion(c, spec)
                check("migrations applied" in out, f"init container output: {out}")
        if mode != "none":
            # The migration step grants the service role of the service URL and makes the
            # fleet login a member of outboxd_fleet: nobody runs SQL by hand after an install.
            granted = pg.psql(f"SELECT has_table_privilege('{role}', 'outbox.intent', 'DELETE')", db)
            check(granted == "t", f"the migration step did not grant the service role {role}")
            member = pg.psql(f"SELECT pg_has_role('{fleet_role}', 'outboxd_fleet', 'USAGE')", db)
            check(member == "t", f"the migration step did not make {fleet_role} a member of outboxd_fleet")
            results["grants"] = "by the migration step"

        # 2. The server, probed like kubelet: startup until it passes, then readiness, liveness.
        log = work / "server.log"
        proc = pod.start(server, spec, log)
        startup = server["startupProbe"]
        budget = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        deadline = time.monotonic() + budget
        last = None
        while True:
            check(proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()}")
            try:
                last = probe_once(startup, port_names, credentials)
                if last == "SERVING":
                    break
            except (grpc.RpcError, OSError) as e:
                last = e
            check(time.monotonic() < deadline, f"startup probe failed for {budget}s: {last}\n{log.read_text()}")
            time.sleep(startup.get("periodSeconds", 10) / 4)
        results["startupProbe"] = last
        for kind in ("readinessProbe", "livenessProbe"):
            results[kind] = probe_once(server[kind], port_names, credentials)
            check(results[kind] == "SERVING", f"{kind}: {results[kind]}")
        if keys:
            # The post-install hook, then a post-upgrade one: the key is stored once, and the
            # server accepts it (and refuses a key nobody stored: authentication is on).
            kjob = one([d for d in by_kind(docs, "Job") if d["metadata"]["name"].endswith("-api-keys")], "Job")
            kspec = kjob["spec"]["template"]["spec"]
            for _ in range(2):
                for c in kspec["containers"]:
                    out = pod.run_to_completion(c, kspec)
                    check(api_key not in out, "the key Job printed the key")
            stored = pg.psql("SELECT count(*) FROM outbox.api_key WHERE name = 'bootstrap' AND revoked_at IS NULL", db)
            check(stored == "1", f"{stored} bootstrap keys stored")
            check(call_with_key(port_names["grpc"], api_key) == grpc.StatusCode.OK, "the server refuses the stored key")
            refused = call_with_key(port_names["grpc"], "obx_" + os.urandom(32).hex())
            check(refused == grpc.StatusCode.UNAUTHENTICATED, f"an unknown key got {refused}")
            results["apiKeys"] = "stored once, accepted"
        if tls:
            # mTLS is required: a client without a certificate is turned away.
            no_cert = grpc.ssl_channel_credentials(root_certificates=files[("ci-tls", "ca.crt")])
            try:
                health(port_names["grpc"], "", no_cert)
                raise AssertionError("a client without a certificate passed mTLS")
            except grpc.RpcError:
                pass
            results["mTLS"] = "client certificate required"
            # What docs/kubernetes.md, values.yaml and NOTES tell operators: the files are
            # read again when they change, so a renewal (the Secret volume's files replaced)
            # reaches new connections without a restart.
            served = renewal_served(work / "tls-material", Path(values["tls"]["mountPath"]), port_names["grpc"])
            check(served, "outboxd did not serve a renewed certificate within 10 s without a restart, as the "
                          "chart's docs say it does")
            results["renewal"] = "served to new connections without a restart, as documented"
            # NOTES' buf curl line, as written (files and port aside), passes TLS and mTLS.
            results["NOTES buf curl"] = run_notes_buf_curl(install_notes, work / "tls-material", port_names["grpc"],
                                                           chart.values["service"]["port"])
        # The metrics endpoint answers where the Service and ServiceMonitor point.
        if "metrics" in port_names:
            path = chart.values["serviceMonitor"]["path"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port_names['metrics']}{path}", timeout=5) as reply:
                body = reply.read().decode()
            check(reply.status == 200 and "# TYPE" in body, f"GET {path}: {reply.status} {body[:200]}")
            results["metrics"] = f"{len(body.splitlines())} lines"
        # The background sweeps (every 100 ms to 1 s) reach the database without errors,
        # which health alone does not show; and logs are what log.format says.
        time.sleep(2.5)
        check(proc.poll() is None, f"server exited {proc.returncode}:\n{log.read_text()}")
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        check(lines and all(line.startswith("{") and json.loads(line) for line in lines), "server logs are not JSON")
        errors = [line for line in lines if json.loads(line).get("level") in ("ERROR", "WARN")]
        check(not errors, "the server logged errors:\n" + "\n".join(errors[:10]))

        # 3. Termination as Kubernetes does it: SIGTERM; during the drain delay readiness
        # fails (endpoints drop the pod) while calls are still served; exit within the grace.
        drain = int(env["OUTBOX_SHUTDOWN__DRAIN_DELAY"].rstrip("s"))
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if drain and ("httpGet" in server["readinessProbe"] or not tls):
            time.sleep(min(1.0, drain / 2))
            readiness = probe_once(server["readinessProbe"], port_names)
            check(readiness == "NOT_SERVING", f"readiness during the drain delay: {readiness}")
            results["draining"] = f"readiness {readiness}"
        grace = spec["terminationGracePeriodSeconds"]
        try:
            code = proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not stop within terminationGracePeriodSeconds={grace}") from None
        took = time.monotonic() - stopped_at
        check(code == 0, f"server exited {code} on SIGTERM:\n{log.read_text()[-2000:]}")
        check(took >= drain * 0.9, f"stopped after {took:.1f}s, before the {drain}s drain delay")
        results["SIGTERM"] = f"exit 0 after {took:.1f}s (grace {grace}s)"
    finally:
        pod.stop_all()
    summary = ", ".join(f"{k}: {v}" for k, v in results.items())
    print(f"     pod: {shlex.join(server['args'])} on :{port_names['grpc']} ({summary})")
    for n in notes:
        print(f"     note: {n}")


def find_buf() -> str | None:
    """buf as .ci/run installs it (or OUTBOXD_BUF, or on PATH)."""
    tmp = Path(os.environ.get("TMPDIR") or "/tmp")
    for candidate in (os.environ.get("OUTBOXD_BUF"), str(tmp / "outboxd-ci-buf/node_modules/.bin/buf"), shutil.which("buf")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def renewal_served(material: Path, mount: Path, port: int) -> bool:
    """Replaces the mounted server certificate and key with a newly issued pair, as the
    kubelet does when cert-manager renews the Secret, then tells whether a new TLS
    connection gets the new certificate."""
    def sh(*a):
        subprocess.run(["openssl", *a], cwd=material, check=True, capture_output=True)
    sh("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=server-renewed",
       "-keyout", "renewed.key", "-out", "renewed.csr")
    sh("x509", "-req", "-in", "renewed.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
       "-days", "2", "-extfile", "server.ext", "-out", "renewed.crt")
    sh("pkcs8", "-topk8", "-nocrypt", "-in", "renewed.key", "-out", "renewed.pk8")
    for name, source in (("tls.crt", "renewed.crt"), ("tls.key", "renewed.pk8")):
        target = mount / name
        mode = target.stat().st_mode & 0o777
        target.chmod(mode | 0o200)
        target.write_bytes((material / source).read_bytes())
        target.chmod(mode)
    context = ssl.create_default_context(cafile=str(material / "ca.crt"))
    context.load_cert_chain(str(material / "client.crt"), str(material / "client.pk8"))
    context.set_alpn_protocols(["h2"])
    renewed = ssl.PEM_cert_to_DER_cert((material / "renewed.crt").read_text())
    original = ssl.PEM_cert_to_DER_cert((material / "server.crt").read_text())
    # The server looks at the files again about once a second: a new connection gets the
    # renewed certificate within a few.
    deadline = time.monotonic() + 10
    while True:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                served = tls.getpeercert(binary_form=True)
        check(served in (renewed, original), "the server serves a certificate the test never issued")
        if served == renewed or time.monotonic() > deadline:
            return served == renewed
        time.sleep(0.2)


def run_notes_buf_curl(notes: str, material: Path, port: int, service_port: int) -> str:
    """Runs the `buf curl` line of NOTES.txt in a directory holding the test's ca.crt,
    client.crt and client.key, against the pod's port instead of the port-forward's."""
    buf = find_buf()
    if not buf:
        return "not run (no buf: .ci/run installs it, or set OUTBOXD_BUF)"
    joined = notes.replace("\\\n", " ")
    line = next(l for l in joined.splitlines() if l.strip().startswith("buf curl"))
    argv = shlex.split(line.replace(f"127.0.0.1:{service_port}/", f"127.0.0.1:{port}/"))
    p = subprocess.run([buf, *argv[1:]], cwd=material, capture_output=True, text=True, timeout=60)
    check(p.returncode == 0 and '"SERVING"' in p.stdout, f"NOTES' {line.strip()!r} failed: {p.stdout}{p.stderr}")
    return "SERVING"


def image_of(docs):
    return server_container(one(docs, "Deployment"))["image"]


def make_tls(directory: Path):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    if not shutil.which("openssl"):
        raise Skip("no openssl to make test certificates")
    directory.mkdir(parents=True)

    def sh(*a):
        subprocess.run(["openssl", *a], cwd=directory, check=True, capture_output=True)

    sh("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
       "-subj", "/CN=outboxd-ci-ca", "-keyout", "ca.key", "-out", "ca.crt")
    # The Service's cluster DNS name too: NOTES' buf curl line sends it as the server name.
    for name, ext in (("server", f"subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:{RELEASE}-outboxd.{NAMESPACE}.svc\n"
                                 "extendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (directory / f"{name}.ext").write_text(ext + "\n")
        sh("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", f"/CN={name}",
           "-keyout", f"{name}.key", "-out", f"{name}.csr")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
           "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt")
        # PKCS#8 keys, the format every TLS stack reads.
        sh("pkcs8", "-topk8", "-nocrypt", "-in", f"{name}.key", "-out", f"{name}.pk8")
    read = lambda n: (directory / n).read_bytes()  # noqa: E731
    files = {
        ("ci-tls", "tls.crt"): read("server.crt"),
        ("ci-tls", "tls.key"): read("server.pk8"),
        ("ci-tls", "ca.crt"): read("ca.crt"),
    }
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read("ca.crt"), private_key=read("client.pk8"), certificate_chain=read("client.crt")
    )
    return files, credentials


# ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="outboxd built from this tree")
    parser.add_argument("--pg-url", required=True, help="superuser URL of a throwaway cluster (trust auth)")
    parser.add_argument("--pg-bindir", required=True)
    parser.add_argument("--work", required=True, help="scratch directory")
    parser.add_argument("--image-check", help="script building and checking the image (exit 77: skipped)")
    args = parser.parse_args()

    r = Results()
    chart = helm.Chart.load(CHART)
    print(f"helm SDK {helm.helm_sdk_version()}, kubernetes-validate schemas {', '.join(KUBE_VERSIONS)}")
    binary = Binary(args.binary)
    print(f"     binary: {binary.version} ({args.binary})")

    def documented():
        missing = undocumented_values((CHART / "values.yaml").read_text())
        check(not missing, f"values without a '# --' comment: {missing}")
        drift = schema_drift(chart.values, json.loads((CHART / "values.schema.json").read_text()))
        check(not drift, f"schema keys without a default in values.yaml: {drift}")
    r.run("values.yaml: every value has a '# --' comment and the schema no orphan key", documented)

    # The schema's OUTBOX_* names are the table of docs/configuration.md (which a unit test
    # holds to config::Settings), and this outboxd accepts every one of them.
    def schema_variables():
        schema = json.loads((CHART / "values.schema.json").read_text())
        listed = schema["definitions"]["outboxVariable"]["enum"]
        table = [line.split("|")[1].strip().strip("`")
                 for line in (ROOT / "docs" / "configuration.md").read_text().splitlines()
                 if line.startswith("| `OUTBOX_")]
        check(listed == table, f"values.schema.json outboxVariable differs from docs/configuration.md: "
                               f"missing {sorted(set(table) - set(listed))}, extra {sorted(set(listed) - set(table))}, "
                               "or another order")
        unknown = binary.unknown(listed)
        check(not unknown, f"the schema accepts variables this outboxd refuses: {unknown}")
        # The probe itself: a misspelt name must register as refused, or every such check is void.
        check(binary.unknown(["OUTBOX_DATABASE_URL"]) == ["OUTBOX_DATABASE_URL"],
              "Binary.unknown does not recognise outboxd's refusal of an unknown variable (its message changed?)")
        return len(listed)
    count = r.run("values.schema.json: OUTBOX_* names = docs/configuration.md, all accepted by outboxd", schema_variables)
    if count:
        print(f"     {count} variables")

    # Lint, with the defaults and every value set.
    def lint(values=None):
        report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
        problems = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
        check(not problems, f"lint: {problems}")

    value_files = sorted((HERE / "values").glob("*.yaml"))
    value_sets = [("default", {})] + [(p.name, load_values(p)) for p in value_files]
    # `# kube-min: 1.30.0` in a values file: it uses fields older Kubernetes lacks.
    kube_min = {p.name: header(p, "kube-min") for p in value_files}
    for name, values in value_sets:
        r.run(f"lint ({name})", lint, values)

    # Render, validate, wire and meet expectations; with the monitoring API available.
    for name, values in value_sets:
        def render_and_check(name=name, values=values):
            docs, notes = render(chart, values, MONITORING_API)
            validated = validate_k8s(docs, kube_min.get(name))
            check_wiring(docs, image_of(docs), binary)
            if name in EXPECTATIONS:
                EXPECTATIONS[name](docs, notes)
            return validated
        done = r.run(f"render + kubernetes-validate --strict + wiring ({name})", render_and_check)
        if done:
            print(f"     {', '.join(done)}")
    check_names = {n for n, _ in value_sets}
    missing = sorted(set(EXPECTATIONS) - check_names)
    r.run("every expectation has its value set", lambda: check(not missing, f"no values file for {missing}"))

    # Capabilities: the ServiceMonitor exists only where the API does.
    def service_monitor_gating():
        values = load_values(HERE / "values" / "servicemonitor.yaml")
        with_api, _ = render(chart, values, MONITORING_API)
        without, notes = render(chart, values, [])
        check(by_kind(with_api, "ServiceMonitor"), "no ServiceMonitor although the API is served")
        check(not by_kind(without, "ServiceMonitor"), "ServiceMonitor rendered for a cluster without the CRD")
        check("no ServiceMonitor was created" in notes, "NOTES do not say the ServiceMonitor was skipped")
        default, _ = render(chart, {}, MONITORING_API)
        check(not by_kind(default, "ServiceMonitor"), "ServiceMonitor rendered while disabled")
        # serviceMonitor.force: `helm template` without --api-versions still renders it.
        forced_values = {**values, "serviceMonitor": {**values["serviceMonitor"], "force": True}}
        forced, forced_notes = render(chart, forced_values, [])
        check(by_kind(forced, "ServiceMonitor") == by_kind(with_api, "ServiceMonitor"),
              "serviceMonitor.force without the API renders no (or another) ServiceMonitor")
        check("no ServiceMonitor was created" not in forced_notes, "NOTES say a forced ServiceMonitor was skipped")
        check("force" in notes, "NOTES do not name serviceMonitor.force")
        unforced, _ = render(chart, {"serviceMonitor": {"force": True}}, [])
        check(not by_kind(unforced, "ServiceMonitor"), "serviceMonitor.force rendered one while disabled")
    r.run("serviceMonitor only with monitoring.coreos.com/v1 (--api-versions) or serviceMonitor.force",
          service_monitor_gating)

    # The console: off by default (its variable unset, not empty); with TLS it serves HTTPS
    # with the gRPC certificate, and NOTES say so.
    def console_tls():
        values = {**load_values(HERE / "values" / "tls.yaml"), "console": {"enabled": True}}
        docs, notes = render(chart, values, MONITORING_API)
        validate_k8s(docs)
        check_wiring(docs, image_of(docs), binary)
        env = env_map(server_container(one(docs, "Deployment")))
        check(env["OUTBOX_CONSOLE__LISTEN_ADDR"]["value"] == "0.0.0.0:8080", "console.port default")
        check("https://ci-outboxd.outboxd-ci.svc:8080/" in notes, "NOTES do not open the console over https")
        check("plaintext" not in notes, "NOTES call the TLS console plaintext")
        off, off_notes = render(chart, {"console": {"enabled": False, "port": 8081}}, MONITORING_API)
        for owner, spec, _ in pod_specs(off):
            for c in spec.get("initContainers", []) + spec["containers"]:
                check("OUTBOX_CONSOLE__LISTEN_ADDR" not in env_map(c), f"{owner} {c['name']}: console address while disabled")
        check("console" not in {p["name"] for p in one(off, "Service")["spec"]["ports"]}, "console Service port while disabled")
        check("console" not in off_notes, "NOTES mention a disabled console")
    r.run("console: unset while disabled, HTTPS with tls.enabled", console_tls)

    # Release `outbox`: its Services (outbox-outboxd, …) give every pod of the namespace
    # OUTBOX_OUTBOXD_SERVICE_HOST and the like. outboxd tells them from its own variables by
    # name and value and leaves them alone; every pod of the chart (server, migration Job,
    # key Job) turns service links off anyway.
    def service_links():
        values = {"apiKeys": load_values(HERE / "values" / "api-keys.yaml")["apiKeys"], "service": {"headless": True}}
        docs, _ = render(chart, values, MONITORING_API, release="outbox")
        links = [n for n in service_link_variables(by_kind(docs, "Service")) if n.startswith("OUTBOX_")]
        check("OUTBOX_OUTBOXD_SERVICE_HOST" in links, f"kubelet variables of release outbox: {links}")
        refused = binary.refused_service_links(links)
        check(not refused, f"this outboxd refuses service-link variables with the kubelet's values: {refused}")
        owners = [owner for owner, _, _ in pod_specs(docs)]
        check(len(owners) == 3, f"expected the Deployment and two Jobs: {owners}")
        for owner, spec, _ in pod_specs(docs):
            check(spec.get("enableServiceLinks") is False, f"{owner} keeps service links ({links[:3]}…)")
        return f"outboxd leaves alone all {len(links)} OUTBOX_* service-link variables of release outbox; no pod gets them"
    done = r.run("service links: ignored by outboxd, and off in every pod (release outbox)", service_links)
    if done:
        print(f"     {done}")

    # terminationGracePeriodSeconds covers a preStop sleep too: SIGTERM comes after it.
    def pre_stop_counted():
        base = {"terminationGracePeriodSeconds": 30, "shutdown": {"drainDelaySeconds": 5, "graceSeconds": 20}}
        cases = [  # (lifecycle, seconds it holds SIGTERM back)
            ({"preStop": {"sleep": {"seconds": 5}}}, 5),
            ({"preStop": {"exec": {"command": ["sleep", "5"]}}}, 5),
            ({"preStop": {"exec": {"command": ["/bin/sleep", "5s"]}}}, 5),
            ({"preStop": {"exec": {"command": ["sh", "-c", "sleep 2; /usr/bin/sleep 3"]}}}, 5),
            ({"preStop": {"exec": {"command": ["sh", "-c", "sleep 0.5 && sleep 4"]}}}, 4.5),
            ({"preStop": {"exec": {"command": ["sleep", "1m"]}}}, 60),
            ({"preStop": {"httpGet": {"path": "/quit", "port": 8080}}}, 0),  # unknowable: documented
            ({"postStart": {"exec": {"command": ["sleep", "10"]}}}, 0),
        ]
        for lifecycle, held in cases:
            for grace, ok in ((int(25 + held + 1), True), (int(25 + held), False)):
                values = {**base, "lifecycle": lifecycle, "terminationGracePeriodSeconds": grace}
                try:
                    render(chart, values)
                    check(ok, f"{lifecycle} with terminationGracePeriodSeconds={grace} rendered: the {held}s preStop "
                              "sleep is not counted")
                except (helm.HelmValuesError, helm.HelmRenderError) as e:
                    check(not ok and "terminationGracePeriodSeconds must exceed" in str(e),
                          f"{lifecycle} with terminationGracePeriodSeconds={grace} refused: {e}")
        return len(cases)
    r.run("terminationGracePeriodSeconds check counts lifecycle.preStop's sleep (action or exec)", pre_stop_counted)

    # defaultTopologySpread: on by default (expect_default), kept when the user spreads over
    # another key (kitchen-sink), replaced by the user's own over nodes, and off at will.
    def topology_spread_defaults():
        own = [{"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "outboxd"}}}]
        docs, _ = render(chart, {"topologySpreadConstraints": own})
        validate_k8s(docs)
        check_wiring(docs, image_of(docs), binary)
        got = one(docs, "Deployment")["spec"]["template"]["spec"]["topologySpreadConstraints"]
        check(got == own, f"the user's own constraint over nodes should replace the default: {got}")
        docs, _ = render(chart, {"defaultTopologySpread": {"enabled": False}})
        check("topologySpreadConstraints" not in one(docs, "Deployment")["spec"]["template"]["spec"],
              "defaultTopologySpread.enabled=false still spreads")
        docs, _ = render(chart, {"defaultTopologySpread": {"topologyKey": "topology.kubernetes.io/zone", "maxSkew": 2,
                                                           "whenUnsatisfiable": "DoNotSchedule"}})
        validate_k8s(docs)
        got = one(docs, "Deployment")["spec"]["template"]["spec"]["topologySpreadConstraints"]
        check([(c["topologyKey"], c["maxSkew"], c["whenUnsatisfiable"]) for c in got]
              == [("topology.kubernetes.io/zone", 2, "DoNotSchedule")], f"defaultTopologySpread values ignored: {got}")
    r.run("defaultTopologySpread: replaced by a user constraint of its key, configurable, off at will",
          topology_spread_defaults)

    # The Jobs' default requests can be removed (null) and made into requests + limits.
    def job_resources():
        docs, _ = render(chart, {"migrations": {"resources": None}, "apiKeys": load_values(HERE / "values" / "api-keys.yaml")["apiKeys"]})
        for owner, spec, _ in pod_specs(docs):
            if owner.startswith("Job/"):
                for c in spec["containers"]:
                    check("resources" not in c, f"{owner} {c['name']}: resources despite migrations.resources=null")
        docs, _ = render(chart, {"migrations": {"resources": {"limits": {"memory": "128Mi"}}}})
        validate_k8s(docs)
        res = one(docs, "Job")["spec"]["template"]["spec"]["containers"][0]["resources"]
        check(res == {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}, f"merged resources {res}")
    r.run("migrations.resources: default requests on the Jobs, null removes them", job_resources)

    # Bad values: each must be rejected, by the schema or by a template guard.
    for path in sorted((HERE / "bad-values").glob("*.yaml")):
        expect = header(path, "expect")
        by = header(path, "rejected-by")

        def rejected(path=path, expect=expect, by=by):
            check(expect and by in ("schema", "template"), f"{path.name}: needs '# expect:' and '# rejected-by:' headers")
            values = load_values(path)
            if by == "schema":
                try:
                    chart.validate_schema(values)
                    raise AssertionError("the schema accepted it")
                except helm.HelmValuesError as e:
                    check(expect in str(e), f"rejected for another reason: {e}")
            else:
                chart.validate_schema(values)
            try:
                render(chart, values, MONITORING_API)
                raise AssertionError("render accepted it")
            except (helm.HelmValuesError, helm.HelmRenderError) as e:
                check(expect in str(e), f"render rejected it for another reason: {e}")
            return str(expect)
        r.run(f"rejected by the {by}: {path.name}", rejected)

    # The digest guard in _helpers.tpl holds even when the schema is skipped.
    def digest_guard_without_schema():
        copy = Path(args.work) / "chart-without-schema"
        shutil.copytree(CHART, copy)
        (copy / "values.schema.json").unlink()
        bare = helm.Chart.load(copy)
        try:
            render(bare, {"image": {"digest": "sha256:XYZ"}})
            raise AssertionError("a malformed digest rendered")
        except helm.HelmRenderError as e:
            check("image.digest" in str(e) and "malformed" in str(e), str(e))
    r.run("template fails on a malformed digest without the schema", digest_guard_without_schema)

    # Runtime: the rendered pod, run for real.
    pg = Postgres(args.pg_url, args.pg_bindir)
    r.run("runtime: default values (hook Job, then server) probed like kubelet", runtime_test, args, chart, binary, pg, "hook")
    r.run("runtime: migrations.mode=initContainer + apiKeys (init container, server, key Job: the key bootstrap)",
          runtime_test, args, chart, binary, pg, "initContainer", keys=True)

    def tls_runtime():
        runtime_test(args, chart, binary, pg, "none", tls=True)
    r.run("runtime: tls + clientCA (mounted Secret files, HTTP probes on the admin port, mTLS health)", tls_runtime)

    if args.image_check:
        def image():
            p = subprocess.run(["bash", args.image_check, args.binary], capture_output=True, text=True, timeout=1200)
            out = (p.stdout + p.stderr).strip()
            print("     " + out.replace("\n", "\n     "))
            if p.returncode == 77:
                raise Skip(out.splitlines()[-1] if out else "skipped")
            check(p.returncode == 0, f"image check exited {p.returncode}")
        r.run("image: runtime stage rebuilt FROM scratch with the local binary (ci/chart/image-check.sh)", image)

    print()
    for name, detail in r.failed:
        print(f"FAILED: {name}")
    for name, why in r.skipped:
        print(f"SKIPPED: {name}: {why}")
    line = f"chart: {len(r.passed)} passed, {len(r.failed)} failed"
    if r.skipped:
        line += f", {len(r.skipped)} skipped"
    print(line)
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
