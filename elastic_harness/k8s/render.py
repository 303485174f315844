"""``render``: spec -> manifests; ``manifest_files``: manifests -> a kustomize directory."""

from __future__ import annotations

import dataclasses
import re

import yaml

from elastic_harness import __version__
from elastic_harness.k8s.common import (
    FLAVORS,
    JOB_DIR,
    JOB_LABEL,
    RenderError,
    Target,
    job_id,
    labels,
    metadata,
    names_for,
    obj,
)
from elastic_harness.k8s.flavors import render_plain, render_pytorchjob
from elastic_harness.k8s.pod import uses_s3
from elastic_harness.k8s.trainjob import render_trainjob
from elastic_harness.spec import JobSpec, dump_job

DEFAULT_IMAGE = f"elastic-harness:{__version__}"
KUSTOMIZATION = "kustomization.yaml"
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def render(
    spec: JobSpec, flavor: str, image: str = DEFAULT_IMAGE, namespace: str | None = None,
    script_files: dict[str, str] | None = None,
) -> list[dict]:
    """Every object the job needs, in apply order (config and storage before pods).

    ``script_files``: a script job's files (read by the caller, ``scriptfiles``), path
    relative to the script's directory -> text, the script first: shipped in the ConfigMap
    beside job.yaml, whose ``script.path`` then names the script there."""
    if flavor not in FLAVORS:
        raise RenderError(f"unknown flavor '{flavor}'", f"choose one of {', '.join(FLAVORS)}")
    if not image or any(c.isspace() for c in image):
        raise RenderError(f"image '{image}' is not an image reference", "e.g. --image repo/x:tag")
    if namespace and not _DNS1123_LABEL.match(namespace):
        raise RenderError(f"namespace '{namespace}' is not a valid namespace name", "e.g. ml-jobs")
    config, paths = job_config(spec, script_files)
    target = Target(spec, names_for(spec), image, namespace or None, paths)
    renderers = {"pytorchjob": render_pytorchjob, "plain": render_plain, "trainjob": render_trainjob}
    pods = renderers[flavor](target)
    return [*_shared(target, config), *pods]


# A ConfigMap holds at most 1 MiB; leave room for job.yaml and the object's own fields.
SCRIPT_LIMIT = 900 * 1024


def job_config(spec: JobSpec, files: dict[str, str] | None) -> tuple[dict[str, str], tuple]:
    """The ConfigMap's data: job.yaml, and a script job's files beside it (mounted at
    ``JOB_DIR``; job.yaml's ``script.path`` names the script there); and, when a file lives
    in a subdirectory (a package), every key's path (``Target.config_paths``).

    A ConfigMap key cannot hold '/': a package's ``pkg/mod.py`` is key ``pkg.mod.py`` (no
    importable module's file name has a dot before ``.py``, so keys cannot clash)."""
    if not spec.script.path or not files:
        return {"job.yaml": dump_job(spec)}, ()
    size = sum(len(text.encode()) for text in files.values())
    if size > SCRIPT_LIMIT:
        biggest = ", ".join(f"{p} ({len(t.encode()) // 1024} KiB)" for p, t in
                            sorted(files.items(), key=lambda kv: -len(kv[1].encode()))[:3])
        raise RenderError(f"the script and the modules beside it that it imports ({len(files)} files, "
                          f"{size // 1024} KiB; largest {biggest}) are too large to ship in the job's "
                          f"ConfigMap (over {SCRIPT_LIMIT // 1024} KiB)",
                          "put them in the image and set script.path to the script's absolute path there")
    keys = {path.replace("/", "."): path for path in files}
    if len(keys) != len(files) or "job.yaml" in keys:
        raise RenderError(f"two of the script's files would share a ConfigMap key: {sorted(files)}",
                          "rename one of them, or put them in the image")
    script = next(iter(files))
    shipped = dataclasses.replace(spec, script=dataclasses.replace(spec.script, path=f"{JOB_DIR}/{script}"))
    data = {"job.yaml": dump_job(shipped), **{key: files[path] for key, path in keys.items()}}
    nested = any("/" in path for path in files)
    return data, (tuple((key, keys.get(key, key)) for key in data) if nested else ())


def _shared(target: Target, config: dict[str, str]) -> list[dict]:
    """The job file, its storage, who may reach its pods, and how many may be evicted."""
    out = [obj("v1", "ConfigMap", metadata(target, target.names.config), data=config)]
    if not uses_s3(target):
        out.append(_volume_claim(target))
    return [*out, _network_policy(target), _worker_budget(target)]


def _volume_claim(target: Target) -> dict:
    deploy = target.spec.deploy
    claim: dict = {
        "accessModes": ["ReadWriteMany"],  # every node pod reads every checkpoint
        "resources": {"requests": {"storage": deploy.storage}},
    }
    if deploy.storage_class:
        claim["storageClassName"] = deploy.storage_class
    meta = metadata(target, target.names.volume_claim)
    return obj("v1", "PersistentVolumeClaim", meta, spec=claim)


def _network_policy(target: Target) -> dict:
    """The c10d store and gloo/NCCL have no authentication: only this job's pods get in,
    picked by ``JOB_LABEL`` (this submission's id, on its pods only), not by the labels
    every job of this name carries.

    Collective ports are ephemeral, so the policy admits every port between the job's pods.
    """
    mine = {"matchLabels": {**labels(target), JOB_LABEL: job_id(target)}}
    policy = {
        "podSelector": mine,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": mine}]}],
    }
    meta = metadata(target, target.names.base)
    return obj("networking.k8s.io/v1", "NetworkPolicy", meta, spec=policy)


def _worker_budget(target: Target) -> dict:
    """Voluntary evictions may take node pods only down to nodes.min."""
    selector = {"matchLabels": labels(target, "worker")}
    budget = {"minAvailable": target.spec.nodes.min, "selector": selector}
    meta = metadata(target, target.names.worker, "worker")
    return obj("policy/v1", "PodDisruptionBudget", meta, spec=budget)


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the embedded job YAML stays readable), no aliases."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(manifests: list[dict]) -> str:
    """Multi-document YAML, one document per object."""
    docs = [yaml.dump(m, Dumper=_Dumper, sort_keys=False) for m in manifests]
    return "---\n" + "---\n".join(docs)


def file_name(manifest: dict) -> str:
    return f"{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"


def manifest_files(manifests: list[dict], flavor: str, source: str) -> dict[str, str]:
    """File name -> text: one file per object plus the kustomization listing them."""
    header = (
        f"# Generated by `elastic-harness k8s render {source} --flavor {flavor}`.\n"
        "# Do not edit: change the job and render again (see k8s/DEPLOY.md).\n"
    )
    files = {file_name(m): header + to_yaml([m]) for m in manifests}
    assert len(files) == len(manifests), "two rendered objects share a file name"
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": list(files),
    }
    files[KUSTOMIZATION] = header + yaml.dump(kustomization, Dumper=_Dumper, sort_keys=False)
    return files
