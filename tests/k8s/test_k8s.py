"""Kubernetes rendering: golden trees, real validators (kustomize, kubernetes-validate, the
PyTorchJob, TrainJob, TrainingRuntime and JobSet CRD schemas), and the properties the
manifests promise (see k8s/DEPLOY.md)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from elastic_harness import exitcodes
from elastic_harness.cli import build_parser, main
from elastic_harness.k8s import FLAVORS, RenderError, manifest_files, render, to_yaml
from elastic_harness.spec import load_job, parse_job

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
QUICKSTART = "jobs/quickstart.yaml"  # k8s/plain and k8s/pytorchjob are rendered from it
CRDS = REPO / "k8s" / "crds"  # vendored: see its README
# (apiVersion, kind) -> the vendored CRD file whose openAPIV3Schema the API server applies
CRD_FILES = {("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
             ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
             ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): "trainer.kubeflow.org_trainingruntimes.yaml",
             ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.x-k8s.io_jobsets.yaml"}
KUBE_VERSION = "1.32.0"  # kubectl here is 1.32; kubernetes-validate ships this schema set
JOBS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "jobs").glob("*.yaml"))
REGEN = "regenerate: elastic-harness k8s render {src} --flavor {flavor} --out k8s/{flavor}"

SMALL = ("name: demo\ntask: {target: 'elastic_harness.tasks.mlp:MLPRegression'}\n"
         "nodes: {min: 2, max: 4}\nnproc_per_node: 2\n")
# variants that exercise every branch of the renderer
VARIANTS = {
    "c10d": SMALL,
    "etcd": SMALL + "rendezvous: {backend: etcd}\n",
    "s3-gpu": SMALL
    + "device: cuda\ncheckpoint: {dir: 's3://bucket/ckpt'}\n"
    + "deploy: {gpus: 2, storage_class: nfs}\n",
}


def _source(flavor: str) -> str:
    first = (K8S / flavor / "kustomization.yaml").read_text().splitlines()[0]
    match = re.search(r"k8s render (\S+) --flavor", first)
    assert match, f"k8s/{flavor}/kustomization.yaml lost its generated header"
    return match.group(1)


def _templates(manifests: list[dict]) -> list[dict]:
    """Pod templates of StatefulSets, of the PyTorchJob's replicas and of the
    TrainingRuntime's replicated jobs."""
    out = []
    for m in manifests:
        if m["kind"] == "StatefulSet":
            out.append(m["spec"]["template"])
        elif m["kind"] == "PyTorchJob":
            out += [r["template"] for r in m["spec"]["pytorchReplicaSpecs"].values()]
        elif m["kind"] == "TrainingRuntime":
            out += [r["template"]["spec"]["template"] for r in m["spec"]["template"]["spec"]["replicatedJobs"]]
    return out


def _node_container(manifests: list[dict]) -> dict:
    (tpl,) = [
        t
        for t in _templates(manifests)
        if t["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]
    (c,) = tpl["spec"]["containers"]
    return c


def _one(manifests: list[dict], kind: str, name: str | None = None) -> dict:
    found = [m for m in manifests if m["kind"] == kind and name in (None, m["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def _flags(container: dict) -> dict:
    args = container["args"][1:]
    return dict(zip(args[::2], args[1::2], strict=True))


def _strict(schema: object) -> object:
    """The CRD schema with unknown fields rejected, as `kubectl apply` (strict) does."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are megabytes of YAML
    crd = yaml.load((CRDS / CRD_FILES[(api_version, kind)]).read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == api_version.rsplit("/", 1)[1]]
    return jsonschema.Draft202012Validator(_strict(version["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def crd_validator() -> dict:
    """(apiVersion, kind) -> a validator of that custom resource."""
    return {key: _crd_validator(*key) for key in CRD_FILES}


def _embedded(runtime: dict) -> list[dict]:
    """What a TrainingRuntime embeds, as the objects Trainer and JobSet make of it: the
    JobSet (its template's spec), and each replicated job's batch/v1 Job."""
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": runtime["metadata"]["name"]}, "spec": runtime["spec"]["template"]["spec"]}
    jobs = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{runtime['metadata']['name']}-{r['name']}"},
             "spec": r["template"]["spec"]} for r in jobset["spec"]["replicatedJobs"]]
    return [jobset, *jobs]


def _validate_all(manifests: list[dict], crd_validator: dict) -> None:
    for m in manifests:
        key = (m["apiVersion"], m["kind"])
        if key in crd_validator:
            crd_validator[key].validate(m)
            for inner in _embedded(m) if m["kind"] == "TrainingRuntime" else []:
                _validate_all([inner], crd_validator)
        else:
            assert "." not in m["apiVersion"].split("/")[0] or m["apiVersion"].split("/")[0].endswith(".k8s.io"), \
                f"{key}: a custom resource without a vendored CRD"
            kubernetes_validate.validate(m, KUBE_VERSION, strict=True)


# -- golden trees and the real tools ------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_tree_equals_render(flavor: str) -> None:
    src = _source(flavor)
    want = manifest_files(render(load_job(REPO / src), flavor), flavor, src)
    have = {p.name: p.read_text() for p in (K8S / flavor).glob("*.yaml")}
    hint = REGEN.format(src=src, flavor=flavor)
    assert sorted(have) == sorted(want), hint
    for name in want:
        assert have[name] == want[name], f"k8s/{flavor}/{name} differs; {hint}"


def test_tree_comes_from_quickstart() -> None:
    for flavor in FLAVORS:
        assert _source(flavor) == QUICKSTART, REGEN.format(src=QUICKSTART, flavor=flavor)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("flavor", FLAVORS)
def test_kustomize_builds(flavor: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / flavor)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout)}
    rendered = render(load_job(REPO / _source(flavor)), flavor)
    assert built == {(m["kind"], m["metadata"]["name"]) for m in rendered}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_kubernetes_validate_cli_strict(flavor: str) -> None:
    files = sorted(str(p) for p in (K8S / flavor).glob("*.yaml") if p.name != "kustomization.yaml")
    cmd = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", KUBE_VERSION, *files]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout
    passed = out.stdout.count("INFO")  # custom resources only warn: the CRD tests check them
    assert passed == sum(not re.search(r"^apiVersion: (\S+\.)?kubeflow\.org/", Path(f).read_text(), re.M)
                         for f in files)


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_every_job_renders_valid(job: str, flavor: str, crd_validator) -> None:
    _validate_all(render(load_job(REPO / job), flavor), crd_validator)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_variants_valid(variant: str, flavor: str, crd_validator) -> None:
    _validate_all(render(parse_job(VARIANTS[variant]), flavor, "r/x:1", "ns"), crd_validator)


def test_strict_validation_is_live() -> None:
    workers = _one(render(parse_job(SMALL), "plain"), "StatefulSet", "demo-worker")
    bad = copy.deepcopy(workers)
    bad["spec"]["template"]["spec"]["containers"][0]["gracePeriod"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="gracePeriod"):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_crd_check_is_live(crd_validator) -> None:
    (job,) = [m for m in render(parse_job(SMALL), "pytorchjob") if m["kind"] == "PyTorchJob"]
    bad = copy.deepcopy(job)
    bad["spec"]["elasticPolicy"]["minReplicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _validate_all([bad], crd_validator)
    bad = copy.deepcopy(job)
    bad["spec"]["elasticPolicy"]["minNodes"] = 2
    with pytest.raises(jsonschema.ValidationError):
        _validate_all([bad], crd_validator)


def test_trainjob_crd_checks_are_live(crd_validator) -> None:
    """Each of the TrainJob's, the TrainingRuntime's, the embedded JobSet's and the
    embedded Job's schemas rejects what it must (Trainer 2.2 removed ElasticPolicy)."""
    manifests = render(parse_job(SMALL), "trainjob")
    job, runtime = _one(manifests, "TrainJob"), _one(manifests, "TrainingRuntime")
    _validate_all([job, runtime], crd_validator)
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNodes"] = "four"
    with pytest.raises(jsonschema.ValidationError):
        _validate_all([bad], crd_validator)
    bad = copy.deepcopy(runtime)
    bad["spec"]["mlPolicy"]["torch"]["elasticPolicy"] = {"minNodes": 2}
    with pytest.raises(jsonschema.ValidationError, match="elasticPolicy"):
        _validate_all([bad], crd_validator)
    bad = copy.deepcopy(runtime)  # a JobSet field misspelt in the embedded template
    bad["spec"]["template"]["spec"]["replicatedJobs"][0]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        crd_validator[("jobset.x-k8s.io/v1alpha2", "JobSet")].validate(_embedded(bad)[0])
    bad = copy.deepcopy(runtime)  # a pod field misspelt deep inside: the core schema's check
    bad["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["gracePeriod"] = 5
    with pytest.raises(kubernetes_validate.ValidationError, match="gracePeriod"):
        kubernetes_validate.validate(_embedded(bad)[1], KUBE_VERSION, strict=True)


# -- what the manifests promise -----------------------------------------------------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_no_secret_values(flavor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sentinel-secret-value")
    spec = parse_job(VARIANTS["s3-gpu"])
    manifests = render(spec, flavor)
    text = to_yaml(manifests)
    assert "sentinel-secret-value" not in text
    assert not [m for m in manifests if m["kind"] == "Secret"]
    assert not [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    env = {e["name"]: e for e in _node_container(manifests)["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": spec.deploy.s3_secret, "key": name}
    risky = re.compile("SECRET|TOKEN|PASSWORD|KEY", re.I)
    # a *_FILE variable names where a mounted Secret is (the job's key), never its content
    assert all("value" not in e for n, e in env.items() if risky.search(n) and not n.endswith("_FILE"))
    assert env["ELASTIC_HARNESS_KEY_FILE"]["value"].startswith("/etc/elastic-harness/key/")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_network_policy_admits_only_job_pods(variant: str, flavor: str) -> None:
    manifests = render(parse_job(VARIANTS[variant]), flavor)
    policy = _one(manifests, "NetworkPolicy")["spec"]
    mine = policy["podSelector"]["matchLabels"]
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": mine}}]}]
    templates = _templates(manifests)
    assert templates
    for tpl in templates:  # workers and etcd members alike
        assert mine.items() <= tpl["metadata"]["labels"].items()


@pytest.mark.parametrize("flavor", FLAVORS)
def test_budget_probes_grace_consistent(flavor: str) -> None:
    spec = parse_job(SMALL + "timeouts: {shutdown_grace: 50}\ndeploy: {endpoint_port: 9100}\n")
    manifests = render(spec, flavor)
    budget = _one(manifests, "PodDisruptionBudget", "demo-worker")["spec"]
    assert budget["minAvailable"] == spec.nodes.min
    c = _node_container(manifests)
    (tpl,) = [t for t in _templates(manifests) if t["spec"]["containers"][0] is c]
    assert budget["selector"]["matchLabels"].items() <= tpl["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["endpoint"] == 9100 == int(_flags(c)["--endpoint-port"])
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "endpoint"}
    grace = tpl["spec"]["terminationGracePeriodSeconds"]
    assert grace == 50 + spec.deploy.grace_margin > spec.timeouts.shutdown_grace
    assert c["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_pods_run_non_root(variant: str, flavor: str) -> None:
    for tpl in _templates(render(parse_job(VARIANTS[variant]), flavor)):
        pod = tpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
            assert c["resources"]["requests"]


# -- the pure renderer ----------------------------------------------------------------------


def test_pytorchjob_elastic_policy_from_spec() -> None:
    spec = parse_job(SMALL + "max_restarts: 7\n")
    job = _one(render(spec, "pytorchjob"), "PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"]) == (2, 4)
    assert (policy["maxRestarts"], policy["rdzvBackend"]) == (7, "c10d")
    # the deprecated elasticPolicy.nProcPerNode is gone (the operator's webhook forbids both)
    assert job["spec"]["nprocPerNode"] == "2" and "nProcPerNode" not in policy
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "ExitCode"
    c = worker["template"]["spec"]["containers"][0]
    assert c["name"] == "pytorch"
    assert c["command"] == ["elastic-harness", "agent"]
    assert c["args"][0] == "/etc/elastic-harness/job.yaml"
    assert "--rdzv-endpoint" not in c["args"]  # the operator passes PET_* instead
    (port,) = [p for p in c["ports"] if p["name"] == "pytorchjob-port"]
    assert port["containerPort"] == policy["rdzvPort"] == spec.deploy.rdzv_port


def test_pytorchjob_with_etcd_renders_etcd() -> None:
    manifests = render(parse_job(VARIANTS["etcd"]), "pytorchjob")
    policy = _one(manifests, "PyTorchJob")["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "etcd"  # PET_RDZV_BACKEND=etcd: ours, on etcd's v3 API
    assert (policy["rdzvHost"], policy["rdzvPort"]) == ("demo-etcd-client", 2379)
    _one(manifests, "Service", "demo-etcd-client")
    assert _one(manifests, "StatefulSet", "demo-etcd")["spec"]["replicas"] == 3


def test_plain_flags_and_etcd() -> None:
    manifests = render(parse_job(SMALL), "plain")
    workers = _one(manifests, "StatefulSet", "demo-worker")["spec"]
    assert workers["replicas"] == 4 and workers["serviceName"] == "demo-worker"
    assert _one(manifests, "Service", "demo-worker")["spec"]["clusterIP"] == "None"
    flags = _flags(workers["template"]["spec"]["containers"][0])
    assert flags["--rdzv-backend"] == "etcd"
    assert flags["--rdzv-endpoint"] == "demo-etcd-client:2379"
    assert (flags["--nnodes"], flags["--nproc-per-node"], flags["--rdzv-id"]) == (
        "2:4",
        "2",
        "demo",
    )
    etcd = _one(manifests, "StatefulSet", "demo-etcd")["spec"]
    args = etcd["template"]["spec"]["containers"][0]["args"]
    assert etcd["replicas"] == 3 and not [a for a in args if "enable-v2" in a]
    image = etcd["template"]["spec"]["containers"][0]["image"]
    assert tuple(int(n) for n in re.search(r":v(\d+)\.(\d+)", image).groups()) >= (3, 6), image
    assert _one(manifests, "Service", "demo-etcd")["spec"]["clusterIP"] == "None"
    claim = _one(manifests, "PersistentVolumeClaim")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]


def trainer_env(job: dict, node_rank: int) -> dict[str, str]:
    """What Kubeflow Trainer v2.3's torch plugin injects into the ``node`` container
    (pkg/runtime/framework/plugins/torch/torch.go): a static torchrun world."""
    trainer = job["spec"]["trainer"]
    name = job["metadata"]["name"]
    return {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}


def test_trainjob_runs_our_agent_elastically(tmp_path: Path) -> None:
    config = pytest.importorskip("elastic_harness.launch.config")
    spec = parse_job(SMALL + "max_restarts: 5\n")
    manifests = render(spec, "trainjob")
    job, runtime = _one(manifests, "TrainJob"), _one(manifests, "TrainingRuntime")
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    assert job["spec"]["trainer"]["numNodes"] == 4 == runtime["spec"]["mlPolicy"]["numNodes"]  # nodes.max pods
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    assert replicated["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    job_spec = replicated["template"]["spec"]
    assert job_spec["template"]["spec"]["restartPolicy"] == "Never" and job_spec["backoffLimit"] == 5
    actions = {r["action"]: r for r in job_spec["podFailurePolicy"]["rules"]}
    assert actions["FailJob"]["onExitCodes"]["values"] == [exitcodes.PERMANENT]
    assert [exitcodes.PREEMPTED, exitcodes.INFRA] in [r.get("onExitCodes", {}).get("values")
                                                      for r in job_spec["podFailurePolicy"]["rules"]]
    c = _node_container(manifests)
    assert c["name"] == "node" and c["command"] == ["elastic-harness", "agent"]
    # Trainer's PET_NNODES is one number; the rendered flags keep the node range elastic
    opts = config.node_options(spec, tmp_path, _agent_flags(c), trainer_env(job, 1))
    assert (opts.min_nodes, opts.max_nodes, opts.nproc_per_node) == (2, 4, 2)
    assert (opts.rdzv_backend, opts.rdzv_endpoint, opts.rdzv_id) == ("etcd-v3", "demo-etcd-client:2379", "demo")
    _one(manifests, "StatefulSet", "demo-etcd")


def _agent_flags(container: dict) -> dict:
    """The rendered flags as ``elastic-harness agent`` parses them (``node_options``' input)."""
    parser = build_parser()
    args = vars(parser.parse_args(["agent", *container["args"]]))
    return {k: v for k, v in args.items() if k in ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint",
                                                    "rdzv_id", "max_restarts", "rdzv_conf")}


def _node_pods(manifests: list[dict], flavor: str) -> int:
    """How many node pods the workload asks for."""
    if flavor == "plain":
        return _one(manifests, "StatefulSet", "demo-worker")["spec"]["replicas"]
    if flavor == "trainjob":
        return _one(manifests, "TrainJob")["spec"]["trainer"]["numNodes"]
    return _one(manifests, "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_hot_spare_is_one_more_node_pod_whose_agent_waits(flavor: str, crd_validator, tmp_path: Path) -> None:
    """`nodes.spares: 1` rendered as 0 did (numNodes: 2, replicas 2): no spare on Kubernetes.
    Now every flavor starts one more node pod, and every agent's node range stays
    nodes.min:nodes.max (the operator's PET_NNODES, Trainer's numNodes, cannot widen it), so
    the extra agent waits in the rendezvous as a spare instead of training as a node."""
    config = pytest.importorskip("elastic_harness.launch.config")
    plain, spare = parse_job(SMALL), parse_job(SMALL, ["nodes.spares=1"])
    manifests = render(spare, flavor)
    _validate_all(manifests, crd_validator)
    assert (_node_pods(render(plain, flavor), flavor), _node_pods(manifests, flavor)) == (4, 5)
    workload = {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}.get(flavor)
    env = (_operator_env(_one(manifests, "PyTorchJob")) if flavor == "pytorchjob"
           else trainer_env(_one(manifests, "TrainJob"), 4) if flavor == "trainjob" else {})
    opts = config.node_options(spare, tmp_path, _agent_flags(_node_container(manifests)), env)
    assert (opts.min_nodes, opts.max_nodes) == (2, 4), f"{workload or 'StatefulSet'}: the spare would train"
    assert render(plain, flavor) == render(parse_job(SMALL, ["nodes.spares=0"]), flavor), "no spares: as before"


@pytest.mark.parametrize("flavor", FLAVORS)
def test_etcd_v2_is_refused_where_the_rendered_etcd_has_no_v2_api(flavor: str) -> None:
    with pytest.raises(RenderError, match="(?s)no v2 API.*rendezvous.backend=etcd"):
        render(parse_job(SMALL + "rendezvous: {backend: etcd-v2}\n"), flavor)


@pytest.mark.parametrize("flavor", FLAVORS)
def test_configmap_holds_the_job(flavor: str) -> None:
    spec = parse_job(SMALL + "train: {steps: 9}\n")
    cm = _one(render(spec, flavor, namespace="team"), "ConfigMap")
    assert cm["metadata"]["namespace"] == "team"
    assert parse_job(cm["data"]["job.yaml"]) == spec


def test_gpus_and_names() -> None:
    spec = parse_job(VARIANTS["s3-gpu"].replace("name: demo", "name: My_Job.v2"))
    manifests = render(spec, "plain")
    assert _one(manifests, "StatefulSet", "my-job-v2-worker")
    limits = _node_container(manifests)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("name: 9lives\n", "cannot name Kubernetes objects"),
        ("name: " + "a" * 41 + "\n", "cannot name Kubernetes objects"),
        ("checkpoint: {dir: runs/x}\n", "not on storage shared by all pods"),
        ("device: cuda\n", "deploy.gpus"),
    ],
)
def test_render_errors(text: str, words: str) -> None:
    with pytest.raises(RenderError, match=re.escape(words)):
        render(parse_job("task: {target: 'a.b:C'}\n" + text), "plain")


def test_flavor_and_image_errors() -> None:
    with pytest.raises(RenderError, match="unknown flavor 'helm'.*"):
        render(parse_job(SMALL), "helm")
    with pytest.raises(RenderError, match="image"):
        render(parse_job(SMALL), "plain", image="bad image")
    with pytest.raises(RenderError, match="namespace"):
        render(parse_job(SMALL), "plain", namespace="Team_A")


# -- the command line -----------------------------------------------------------------------


def test_cli_prints_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["k8s", "render", str(REPO / QUICKSTART), "--flavor", "plain", "--set", "nodes.max=3"])
        == 0
    )
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs == render(load_job(REPO / QUICKSTART, ["nodes.max=3"]), "plain")


def test_cli_writes_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    (tmp_path / "old.yaml").write_text("{}\n")
    args = ["k8s", "render", QUICKSTART, "--flavor", "pytorchjob", "--out", str(tmp_path)]
    assert main(args) == 0
    files = manifest_files(
        render(load_job(REPO / QUICKSTART), "pytorchjob"), "pytorchjob", QUICKSTART
    )
    for name, text in files.items():
        assert (tmp_path / name).read_text() == text
    assert "old.yaml" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["missing.yaml", "--flavor", "plain"], "does not exist"),
        ([QUICKSTART, "--flavor", "plain", "--set", "nodes.maxx=2"], "did you mean 'max'"),
        ([QUICKSTART, "--flavor", "plain", "--set", "name=_x"], "cannot name Kubernetes"),
    ],
)
def test_cli_errors(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    assert main(["k8s", "render", *args]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("flavor", FLAVORS)
def test_agent_accepts_rendered_command(flavor: str) -> None:
    """The rendered args parse with the real ``elastic-harness agent`` parser."""
    parser = build_parser()
    if "agent" not in parser._subparsers._group_actions[0].choices:
        pytest.skip("elastic-harness agent is not written yet")
    c = _node_container(render(parse_job(SMALL), flavor))
    assert c["command"] == ["elastic-harness", "agent"]
    args, extra = parser.parse_known_args(["agent", *c["args"]])
    assert extra == []
    assert args.job == "/etc/elastic-harness/job.yaml"
    assert args.run_dir == "/mnt/elastic-harness/runs/demo"


def _operator_env(job: dict) -> dict[str, str]:
    """The PET_* variables training-operator v1 derives from ``elasticPolicy`` (its
    ElasticEnvVarGenerator): endpoint defaults to ``<job>-worker-0`` when rdzvHost is unset;
    PET_NPROC_PER_NODE only from the deprecated elasticPolicy.nProcPerNode, which we do not set."""
    policy = job["spec"]["elasticPolicy"]
    host = policy.get("rdzvHost", f"{job['metadata']['name']}-worker-0")
    return {
        "PET_RDZV_ENDPOINT": f"{host}:{policy['rdzvPort']}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_RDZV_ID": policy["rdzvId"],
    }


@pytest.mark.parametrize("variant", ["c10d", "etcd"])
def test_agent_reads_operator_env(variant: str, tmp_path: Path) -> None:
    """What the operator injects is enough for the agent's option merge (no flags given)."""
    config = pytest.importorskip("elastic_harness.launch.config")
    spec = parse_job(VARIANTS[variant])
    opts = config.node_options(
        spec, tmp_path, {}, _operator_env(_one(render(spec, "pytorchjob"), "PyTorchJob"))
    )
    assert (opts.min_nodes, opts.max_nodes, opts.nproc_per_node) == (2, 4, 2)
    assert opts.rdzv_id == "demo" and opts.max_restarts == spec.max_restarts
    want = "demo-worker-0:29400" if variant == "c10d" else "demo-etcd-client:2379"
    assert opts.rdzv_endpoint == want


def test_k8s_package_stays_host_side() -> None:
    code = (
        "import sys, elastic_harness.k8s, elastic_harness.commands.k8s\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(("
        "'elastic_harness.runtime', 'elastic_harness.checkpoint', 'elastic_harness.data'))]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- issue 22: etcd TLS + client certificates, the job's key, a per-job label ---------------


@pytest.mark.parametrize("flavor", FLAVORS)
def test_etcd_speaks_tls_and_admits_client_certificates_only(flavor: str) -> None:
    config = pytest.importorskip("elastic_harness.launch.config")
    spec = parse_job(VARIANTS["etcd"])
    manifests = render(spec, flavor)
    etcd = _one(manifests, "StatefulSet", "demo-etcd")["spec"]["template"]["spec"]
    args = etcd["containers"][0]["args"]
    assert "--client-cert-auth=true" in args and "--peer-client-cert-auth=true" in args
    assert not [a for a in args if "http://" in a and "metrics" not in a]
    assert etcd["volumes"] == [{"name": "tls", "secret": {"secretName": "demo-etcd-tls", "defaultMode": 0o440}}]
    c = _node_container(manifests)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["etcd-tls"] == "/etc/elastic-harness/etcd-tls" and mounts["key"] == "/etc/elastic-harness/key"
    if flavor != "pytorchjob":
        environ, flags = {}, {"rdzv_conf": _flags(c)["--rdzv-conf"]}
    else:
        job = _one(manifests, "PyTorchJob")
        conf = job["spec"]["elasticPolicy"]["rdzvConf"]
        environ, flags = {"PET_RDZV_CONF": ",".join(f"{i['key']}={i['value']}" for i in conf)}, {}
    opts = config.node_options(spec, Path("/r"), {"rdzv_endpoint": "demo-etcd-client:2379",
                                                  "rdzv_backend": "etcd", "rdzv_id": "x", **flags}, environ)
    conf = config.rdzv_configs(spec, opts)
    assert conf["protocol"] == "https"
    assert conf["ssl_cert"].endswith("tls.crt") and conf["ssl_cert_key"].endswith("tls.key")


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_network_policy_picks_this_submission_only(flavor: str) -> None:
    spec = parse_job(SMALL + "rendezvous: {id: demo-1a2b3c}\n")
    manifests = render(spec, flavor)
    mine = _one(manifests, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]
    assert mine["elastic-harness.io/job-id"] == "demo-1a2b3c"
    other = render(parse_job(SMALL + "rendezvous: {id: demo-9z8y7x}\n"), flavor)
    for tpl in _templates(other):  # another submission of the same job is not admitted
        assert not mine.items() <= tpl["metadata"]["labels"].items()


def test_deploy_notes_build_the_tag_the_manifests_pull() -> None:
    """k8s/DEPLOY.md and the Dockerfile build the image tag the rendered manifests pull."""
    from elastic_harness import __version__
    from elastic_harness.k8s.render import DEFAULT_IMAGE

    assert f"elastic-harness:{__version__}" == DEFAULT_IMAGE
    for doc in (K8S / "DEPLOY.md", K8S / "Dockerfile"):
        tags = set(re.findall(r"\b(?:elastic-harness|eh):(\d+\.\d+\.\d+)", doc.read_text()))
        assert tags == {__version__}, (doc.name, tags)
    pulled = {tag for flavor in FLAVORS for f in (K8S / flavor).glob("*.yaml")
              for tag in re.findall(r"image: (elastic-harness:\S+)", f.read_text())}
    assert pulled == {DEFAULT_IMAGE}


# -- a script job's modules beside it (issue 33, item 5) ------------------------------------
@pytest.fixture
def script_dir(tmp_path: Path) -> Path:
    """A script importing a sibling module (which imports another) and a package beside it,
    plus a module it never imports."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "train.py": "import sys\nimport helper\nfrom pkg.sub import thing\n\n"
                    "def main():\n    import json\n    print(helper.VALUE + thing.VALUE)\n\nmain()\n",
        "helper.py": "from util import BASE\nVALUE = BASE + 1\n",
        "util.py": "BASE = 40\n",
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/thing.py": "from .deeper import ONE as VALUE\n",
        "pkg/sub/deeper.py": "ONE = 1\n",
        "unused.py": "raise SystemExit('never imported')\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("flavor", FLAVORS)
def test_render_ships_the_modules_a_script_imports_from_beside_it(flavor, script_dir, tmp_path, capsys,
                                                                    crd_validator):
    assert main(["k8s", "render", str(script_dir / "train.py"), "--flavor", flavor]) == 0
    manifests = list(yaml.safe_load_all(capsys.readouterr().out))
    _validate_all(manifests, crd_validator)
    config = _one(manifests, "ConfigMap")["data"]
    assert sorted(config) == ["helper.py", "job.yaml", "pkg.__init__.py", "pkg.sub.__init__.py",
                              "pkg.sub.deeper.py", "pkg.sub.thing.py", "train.py", "util.py"]
    volumes = [v for t in _templates(manifests) for v in t["spec"]["volumes"] if v["name"] == "job"]
    assert volumes
    for volume in volumes:
        paths = {i["key"]: i["path"] for i in volume["configMap"]["items"]}
        assert paths.keys() == config.keys() and paths["pkg.sub.thing.py"] == "pkg/sub/thing.py"
    # The pod's view: the ConfigMap's files where the volume puts them; the script runs there.
    mounted = tmp_path / "mounted"
    for key, path in paths.items():
        (mounted / path).parent.mkdir(parents=True, exist_ok=True)
        (mounted / path).write_text(config[key])
    ran = subprocess.run([sys.executable, str(mounted / "train.py")], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert ran.returncode == 0 and ran.stdout.strip() == "42", ran.stderr
    assert parse_job(config["job.yaml"]).script.path == "/etc/elastic-harness/train.py"


def test_a_script_with_only_flat_siblings_needs_no_items(script_dir, capsys):
    (script_dir / "train.py").write_text("import helper\nprint(helper.VALUE)\n")
    assert main(["k8s", "render", str(script_dir / "train.py"), "--flavor", "plain"]) == 0
    manifests = list(yaml.safe_load_all(capsys.readouterr().out))
    assert sorted(_one(manifests, "ConfigMap")["data"]) == ["helper.py", "job.yaml", "train.py", "util.py"]
    volumes = [v for t in _templates(manifests) for v in t["spec"]["volumes"] if v["name"] == "job"]
    assert volumes and all("items" not in v["configMap"] for v in volumes)


def test_modules_too_large_for_a_configmap_are_one_line(script_dir, capsys):
    (script_dir / "util.py").write_text("BASE = 40\n" + "# padding\n" * 100_000)
    assert main(["k8s", "render", str(script_dir / "train.py"), "--flavor", "plain"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 1 and "util.py (976 KiB)" in err and "put them in the image" in err
