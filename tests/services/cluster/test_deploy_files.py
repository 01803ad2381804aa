"""docker/ and deploy/k8s/ stay consistent with the code: every command line they run parses with
the trserve CLI, every server has a health check wired to gRPC health and a restart policy, workers
ask for a GPU and sit behind a headless Service that the autoscaler's Deployment feeds. (No Docker
engine or cluster runs here; schema checks were done with `docker-compose config`,
check-jsonschema's compose-spec and kubernetes-validate, see README "Deployment".)"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from trserve.services.cli import build_parser

yaml = pytest.importorskip("yaml")
REPO = Path(__file__).resolve().parents[3]


def parses(argv: list[str]) -> None:
    build_parser().parse_args(argv)  # argparse exits (SystemExit) on an unknown flag


def k8s_objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in (REPO / "deploy" / "k8s" / "base").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_compose_services_are_health_checked_restarted_and_parse() -> None:
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"redis", "secrets", "matrix", "worker"}
    assert "--appendonly" in services["redis"]["command"]
    for name in ("redis", "matrix", "worker"):
        assert services[name]["restart"] == "unless-stopped" and services[name]["healthcheck"]["test"], name
    assert services["secrets"]["restart"] == "no"  # one shot
    parses(services["secrets"]["command"])
    for name in ("matrix", "worker"):
        parses(services[name]["command"])
        probe = services[name]["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "trserve.services.cli"]
        parses(probe[4:])
    gpu = yaml.safe_load((REPO / "docker" / "compose.gpu.yaml").read_text())["services"]["worker"]
    parses(gpu["command"])
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_kubernetes_workers_probe_grpc_health_request_a_gpu_and_scale() -> None:
    objects = k8s_objects()
    worker = objects[("Deployment", "trserve-worker")]["spec"]["template"]["spec"]["containers"][0]
    matrix = objects[("Deployment", "trserve-matrix")]["spec"]["template"]["spec"]["containers"][0]
    for container in (worker, matrix):
        parses(container["args"])
        for probe in ("readinessProbe", "livenessProbe"):
            assert "grpc" in container[probe], (container["name"], probe)
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    # readiness asks the Generate service (NOT_SERVING alone while the matrix service refuses the secret),
    # liveness the server's own health: such a worker leaves rotation and is not restarted
    assert worker["readinessProbe"]["grpc"]["service"] == "trserve.v1.Generate"
    assert "service" not in worker["livenessProbe"]["grpc"]
    assert worker["lifecycle"]["preStop"]["exec"]["command"][0] == "python"
    for name in ("trserve-worker", "trserve-matrix"):
        pod = objects[("Deployment", name)]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
        assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    # read-only root filesystems; the worker's writable paths are volumes of the pod
    assert worker["securityContext"]["readOnlyRootFilesystem"] and matrix["securityContext"]["readOnlyRootFilesystem"]
    volumes = {v["name"]: v for v in objects[("Deployment", "trserve-worker")]["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    assert {"/tmp", "/var/cache/trserve/calibration"} <= set(mounts)
    assert all("emptyDir" in volumes[mounts[path]] for path in ("/tmp", "/var/cache/trserve/calibration"))
    assert all("emptyDir" in volumes[name] or volumes[name]["secret"] and mount.get("readOnly")
               for mount in worker["volumeMounts"] for name in [mount["name"]])
    assert {"name": "HOME", "value": "/tmp"} in worker["env"]
    assert objects[("PodDisruptionBudget", "trserve-worker")]["spec"]["minAvailable"] == 1
    assert objects[("Service", "trserve-worker")]["spec"]["clusterIP"] == "None"  # headless: per-call balancing
    hpa = objects[("HorizontalPodAutoscaler", "trserve-worker")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "trserve-worker"}
    assert objects[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"][0]["args"][:2] == \
        ["--appendonly", "yes"]


def test_the_image_installs_the_projects_wheel() -> None:
    """One name in site-packages: the image builds the wheel (the root is the package trserve, each code
    folder trserve.X) and installs it, without its dependencies (the pinned runtime ones come first)."""
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {p.split(".")[0] for p in dirs} == {"trserve"} and dirs["trserve"] == "."
    code = ast.literal_eval(re.search(r"^CODE = (\(.*?\))", (REPO / "setup.py").read_text(), re.M).group(1))
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    wheel_stage = dockerfile[dockerfile.index("AS wheel"):dockerfile.index("AS base")]
    assert "pip wheel --no-deps" in wheel_stage and "__init__.py ./" in wheel_stage
    for folder in {*code, "protos"}:
        assert f"COPY {folder} {folder}" in wheel_stage, folder
    runtime = dockerfile[dockerfile.index("AS base"):]
    assert "COPY --from=wheel /dist /dist" in runtime and "pip install --no-deps /dist/trserve-" in runtime
    assert "PYTHONPATH" not in runtime  # the code comes from site-packages, not a copied tree


def test_every_matrix_service_in_the_manifests_serves_exactly_the_bundled_model() -> None:
    """Issue 28, defect 2: they listen on 0.0.0.0, so without --model anyone reaching them could
    register models first. The spec they name must be the bundled model's (`trserve model-spec`)."""
    from trserve.services.matrix.cli import _served_model

    spec = _served_model("smollm2-135m-instruct")
    expected = f"{spec.fingerprint}:{spec.vocab_size}:{spec.k}"
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]["matrix"]["command"]
    k8s = k8s_objects()[("Deployment", "trserve-matrix")]["spec"]["template"]["spec"]["containers"][0]["args"]
    cmd = [line for line in (REPO / "docker" / "Dockerfile").read_text().splitlines()
           if line.startswith('CMD ["matrix"')]
    import json

    (docker,) = [json.loads(line[len("CMD "):]) for line in cmd]
    for argv in (compose, k8s, docker):
        args = build_parser().parse_args(argv)
        assert args.model == [expected], argv


def test_the_custom_metrics_overlay_scales_workers_on_gauges_they_export() -> None:
    """deploy/k8s/custom-metrics: the base plus an autoscaler on the workers' own load gauges (through
    prometheus-adapter), CPU kept; every metric it names is a family the worker exports, and every
    rule of the adapter exposes one of them per pod."""
    from trserve.services.worker.metrics import WorkerMetrics

    exported = {family.name for family in WorkerMetrics().registry.collect()}
    overlay = REPO / "deploy" / "k8s" / "custom-metrics"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../base"]
    (patch,) = kustomization["patches"]
    assert (patch["target"]["kind"], patch["target"]["name"]) in k8s_objects()
    hpa = yaml.safe_load((overlay / patch["path"]).read_text())
    assert hpa["kind"] == patch["target"]["kind"] and hpa["metadata"]["name"] == patch["target"]["name"]
    pods = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods == ["trserve_active_requests", "trserve_queue_depth"] and set(pods) <= exported
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    rules = yaml.safe_load((overlay / "prometheus-adapter-rules.yaml").read_text())["rules"]
    served = [rule["name"]["as"] for rule in rules]
    assert served == pods
    for rule in rules:
        assert rule["seriesQuery"].split("{")[0] == rule["name"]["as"]
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}


def test_the_overlays_sit_beside_their_base_not_inside_it() -> None:
    """Issue 46: the custom-metrics overlay sat inside its own base, which kustomize refuses ("cycle
    detected"). No kustomization may name a folder that holds it; `kubectl kustomize` builds each where
    kubectl is installed."""
    import shutil
    import subprocess

    found = sorted((REPO / "deploy" / "k8s").rglob("kustomization.yaml"))
    assert len(found) == 5  # deploy/k8s, its base, the custom-metrics, own-model and prometheus-operator overlays
    for path in found:
        for resource in yaml.safe_load(path.read_text())["resources"]:
            target = (path.parent / resource).resolve()
            assert not (target.is_dir() and path.parent.is_relative_to(target)), (path, resource)
    if shutil.which("kubectl") is None:
        return
    for path in found:
        built = subprocess.run(["kubectl", "kustomize", str(path.parent)], capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr


def test_every_matrix_service_shipped_needs_the_workers_secret_and_the_workers_send_it() -> None:
    """Issue 45, defect 5 / issue 46: the shipped matrix services listen on 0.0.0.0, where one without
    the workers' secret handed anyone every tenant's history. Each now reads the secret (and an admin
    one) from a file mounted from a Secret or volume that the workers share, except the admin one."""
    compose = yaml.safe_load((REPO / "docker" / "compose.yaml").read_text())["services"]
    gpu = yaml.safe_load((REPO / "docker" / "compose.gpu.yaml").read_text())["services"]["worker"]
    objects = k8s_objects()
    k8s_matrix = objects[("Deployment", "trserve-matrix")]["spec"]["template"]["spec"]
    k8s_worker = objects[("Deployment", "trserve-worker")]["spec"]["template"]["spec"]
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    import json

    cmds = {line.split(" ", 1)[1] for line in dockerfile.splitlines() if line.startswith("CMD [")}
    (image_matrix,) = [json.loads(c) for c in cmds if c.startswith('["matrix"')]
    (image_worker,) = [json.loads(c) for c in cmds if c.startswith('["worker"')]
    for argv in (compose["matrix"]["command"], k8s_matrix["containers"][0]["args"], image_matrix):
        args = build_parser().parse_args(argv)
        assert args.secret_file and args.admin_secret_file and not args.insecure_no_secret, argv
        worker_secret = args.secret_file
    for argv in (compose["worker"]["command"], gpu["command"], k8s_worker["containers"][0]["args"], image_worker):
        args = build_parser().parse_args(argv)
        assert args.matrix_secret_file == worker_secret, argv
    # compose: the workers mount the workers' secret only; `secrets` writes both before the matrix starts
    assert compose["matrix"]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    assert [v.split(":")[0] for v in compose["worker"]["volumes"]] == ["worker-secret"]
    written = build_parser().parse_args(compose["secrets"]["command"]).files
    assert set(written) == {worker_secret, build_parser().parse_args(compose["matrix"]["command"]).admin_secret_file}
    # k8s: the same split, keys of one Secret (workers mount only theirs)
    def keys_of(pod: dict) -> set[str]:
        return {(v["secret"]["secretName"], item["key"]) for v in pod["volumes"] if "secret" in v
                for item in v["secret"]["items"]}
    assert keys_of(k8s_matrix) == {("trserve-secrets", key) for key in ("worker", "admin", "redis")}
    assert keys_of(k8s_worker) == {("trserve-secrets", "worker"), ("trserve-secrets", "tenant-tokens")}
    matrix_args = build_parser().parse_args(k8s_matrix["containers"][0]["args"])
    assert matrix_args.redis_password_file.startswith("/var/run/trserve/redis-password/")
    # Redis requires that password (requirepass from the same key; its probe authenticates with it)
    redis_pod = objects[("StatefulSet", "redis")]["spec"]["template"]["spec"]["containers"][0]
    assert redis_pod["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_pod["env"]}
    assert env["REDIS_PASSWORD"] == env["REDISCLI_AUTH"] == {"name": "trserve-secrets", "key": "redis"}
    # only workers reach the matrix service's gRPC port, only the matrix service reaches Redis
    matrix_in = objects[("NetworkPolicy", "trserve-matrix")]["spec"]["ingress"]
    grpc_rule = [rule for rule in matrix_in if any(p["port"] == 50052 for p in rule["ports"])]
    assert grpc_rule == [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "trserve-worker"}}}],
                          "ports": [{"port": 50052, "protocol": "TCP"}]}]
    # a NetworkPolicy per component: the workers admit their API and metrics ports only
    (worker_in,) = objects[("NetworkPolicy", "trserve-worker")]["spec"]["ingress"]
    assert {p["port"] for p in worker_in["ports"]} == {50051, 8000, 9464} and "from" not in worker_in
    (redis_in,) = objects[("NetworkPolicy", "redis")]["spec"]["ingress"]
    assert redis_in["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "trserve-matrix"}}}]


def test_trserve_secret_writes_a_fresh_secret_once(tmp_path) -> None:
    """What compose's `secrets` service runs: each missing file gets a new secret (0600, accepted by
    --secret-file), an existing one is kept (a restart keeps the secret the peers hold)."""
    import stat
    import subprocess
    import sys

    from trserve.services.common.security import SharedSecret

    a, b = tmp_path / "a", tmp_path / "b"
    cli = [sys.executable, "-m", "trserve.services.cli", "secret"]
    assert subprocess.run([*cli, str(a), str(b)], capture_output=True, timeout=60).returncode == 0
    first = a.read_text()
    assert stat.S_IMODE(a.stat().st_mode) == 0o600 and first != b.read_text()
    SharedSecret.from_file(a)
    again = subprocess.run([*cli, str(a)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "kept" in again.stdout and a.read_text() == first
    assert first.strip() not in again.stdout
    bad = subprocess.run([*cli, str(tmp_path / "missing" / "c")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot create" in bad.stderr


def test_the_own_model_overlay_mounts_the_model_read_only_and_keeps_the_secrets() -> None:
    """Issue 46, item 5: workers and the matrix service on a model from a volume (a directory or a .gguf
    file), converted into an emptyDir so the root filesystem stays read-only; every flag parses."""
    overlay = REPO / "deploy" / "k8s" / "own-model"
    for name in ("worker-patch.yaml", "matrix-patch.yaml"):
        pod = yaml.safe_load((overlay / name).read_text())["spec"]["template"]["spec"]
        args = build_parser().parse_args(pod["containers"][0]["args"])
        assert args.model in ("/models/MODEL", ["/models/MODEL"]), name
        assert (args.matrix_secret_file if args.command == "worker" else args.secret_file), name
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["/models"]["readOnly"] and volumes["models"]["persistentVolumeClaim"]["readOnly"]
        assert "emptyDir" in volumes[mounts["/var/cache/trserve/models"]["name"]]
    claim = yaml.safe_load((overlay / "models.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_the_service_monitors_scrape_the_ports_the_services_name() -> None:
    """Issue 46, item 4: a ServiceMonitor per component (Prometheus Operator), each on a port its
    Service names "metrics"."""
    objects = k8s_objects()
    monitors = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "prometheus-operator" /
                                        "service-monitors.yaml").read_text()))
    assert {m["metadata"]["name"] for m in monitors} == {"trserve-worker", "trserve-matrix"}
    for monitor in monitors:
        service = objects[("Service", monitor["metadata"]["name"])]
        assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(service["metadata"]["labels"].items())
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]} and endpoint["port"] == "metrics"


def _validate(docs: list[dict], where: str) -> int:
    """Strict schema validation of Kubernetes objects (unknown fields refused); the Prometheus
    Operator's CRDs have no schema there and are skipped. Returns how many were validated."""
    import kubernetes_validate

    checked = 0
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, "1.37.0", strict=True)
            checked += 1
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["apiVersion"].startswith("monitoring.coreos.com/"), (where, doc["kind"])
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{where}: {doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    return checked


def test_every_manifest_and_overlay_validates_strictly() -> None:
    """Issue 46, item 4: every object of the base validates against Kubernetes' schemas (strict: an
    unknown or misplaced field fails), and so does every overlay as kustomize renders it (where kubectl
    is installed; the renders are then checked too)."""
    import shutil
    import subprocess

    pytest.importorskip("kubernetes_validate")
    k8s = REPO / "deploy" / "k8s"
    docs = [d for path in sorted((k8s / "base").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text())
            if d and d.get("kind") != "Kustomization"]
    docs += [yaml.safe_load((k8s / "own-model" / "models.yaml").read_text())]
    assert _validate(docs, "deploy/k8s files") == len(docs) >= 12
    if shutil.which("kubectl") is None:
        return
    for overlay in ("", "custom-metrics", "own-model", "prometheus-operator"):
        built = subprocess.run(["kubectl", "kustomize", str(k8s / overlay)], capture_output=True, text=True, timeout=60)
        assert built.returncode == 0, built.stderr
        rendered = [d for d in yaml.safe_load_all(built.stdout) if d]
        assert _validate(rendered, f"kubectl kustomize deploy/k8s/{overlay}") >= 11


def test_workers_serve_each_tenant_only_to_its_api_key() -> None:
    """Issue 46, item 4: the base workers require tenant tokens, from a key of the same Secret."""
    pod = k8s_objects()[("Deployment", "trserve-worker")]["spec"]["template"]["spec"]
    args = build_parser().parse_args(pod["containers"][0]["args"])
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tenant-tokens"]
    assert volume["secret"]["items"] == [{"key": "tenant-tokens", "path": "tokens.json"}]
    assert args.tenant_tokens == mounts["tenant-tokens"] + "/tokens.json"
    overlay = yaml.safe_load((REPO / "deploy" / "k8s" / "own-model" / "worker-patch.yaml").read_text())
    assert build_parser().parse_args(overlay["spec"]["template"]["spec"]["containers"][0]["args"]).tenant_tokens
