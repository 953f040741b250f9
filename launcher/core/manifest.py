"""A job as a Kubeflow manifest, instead of running it (pure): ``dtrain export k8s``.

The manifest runs the job under the Kubeflow operators: PyTorchJob and TFJob
(``kubeflow.org/v1``) or MPIJob (``kubeflow.org/v2beta1``).

How ranks become pods (docs/clusters.md says the same to users):

* PyTorchJob, ``-np N``: one pod per rank (Master + N-1 Workers), the program run as is;
  the operator sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, the manifest
  LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1.
* PyTorchJob, ``--nproc-per-node K``: one pod per node, each running
  ``torchrun --nproc-per-node K`` (node rank from the operator's RANK).
* TFJob: one pod per task (Chief, Workers, PS, Evaluator); the operator sets TF_CONFIG.
* MPIJob: a launcher pod running ``mpirun -np N`` and N/K worker pods of K slots.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from launcher.base.errors import UsageError
from launcher.core.command import is_python_script
from launcher.core.config import JobConfig, PsConfig
from launcher.core.env import ENV_NAME
from launcher.core.export import (
    INTERPRETER,
    Shape,
    default_name,
    describe_shape,
    job_config,
    job_shape,
)
from launcher.core.specs import role_env
from launcher.core.yamltext import to_yaml

Kind = Literal["pytorchjob", "tfjob", "mpijob"]
KINDS: tuple[Kind, ...] = ("pytorchjob", "tfjob", "mpijob")
RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_PYTHON = "python3"  # in an image: no launcher's interpreter to copy
SSHD = ("/usr/sbin/sshd", "-De")  # what MPIJob workers run: mpirun reaches them over ssh
MAX_POD_NAME = 63  # a DNS label: the operators name pods and services after the job
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?\Z")
NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+\Z")


@dataclass(frozen=True)
class KubeJob:
    """``dtrain export k8s``'s own options: what kind of Kubeflow job, where, from what image."""

    kind: Kind
    image: str
    name: str | None = None  # default: after the program
    namespace: str | None = None  # default: kubectl's current one
    secrets: tuple[str, ...] = ()  # --secret VAR[=SECRET[:KEY]]
    restart_policy: str | None = None  # default: Never, OnFailure with --max-restarts


ONLY_FOR: dict[str, tuple[str, tuple[Kind, ...]]] = {
    # option name -> (its flag, the kinds that take it)
    "workers": ("--workers", ("tfjob",)),
    "ps_tasks": ("--ps", ("tfjob",)),
    "evaluator": ("--evaluator", ("tfjob",)),
    "ps_gpus": ("--ps-gpus", ("tfjob",)),
    "nproc_per_node": ("--nproc-per-node", ("pytorchjob", "mpijob")),
    "nnodes": ("--nnodes", ("pytorchjob", "mpijob")),
}


def kube_config(options: Mapping[str, Any]) -> tuple[JobConfig, KubeJob]:
    """``dtrain export k8s``'s options as the job and its Kubernetes settings."""
    kind: Kind = str(options["kind"]).lower()  # type: ignore[assignment]
    for key, (flag, kinds) in ONLY_FOR.items():
        if options.get(key) and kind not in kinds:
            raise UsageError(
                f"{flag} is for --kind {' or '.join(kinds)}, not {kind}",
                f"drop {flag}, or use --kind {kinds[0]}",
            )
    options = dict(options)
    ps = None
    if kind == "tfjob":
        workers, np = options.get("workers"), options.get("np")
        if workers and np and workers != np:
            raise UsageError(f"-np {np} and --workers {workers} both given", "use one of them")
        options["np"] = workers or np
        if options.get("ps_tasks"):
            ps = PsConfig(
                workers=workers or np or 1,
                ps_tasks=options["ps_tasks"],
                evaluator=bool(options.get("evaluator")),
                ps_gpus=bool(options.get("ps_gpus")),
            )
        elif options.get("evaluator") or options.get("ps_gpus"):
            raise UsageError("--evaluator and --ps-gpus are for jobs with --ps", "add --ps N")
    kube = KubeJob(
        kind=kind,
        image=options["image"],
        name=options.get("name"),
        namespace=options.get("namespace"),
        secrets=tuple(options.get("secrets") or ()),
        restart_policy=options.get("restart_policy"),
    )
    return job_config(options, ps=ps), kube


def render_manifest(config: JobConfig, kube: KubeJob, env: Mapping[str, str]) -> str:
    """The manifest as YAML, with a comment saying what it runs and how to start it."""
    manifest = build_manifest(config, kube, env)
    name, kind = manifest["metadata"]["name"], manifest["kind"]
    specs = replica_specs(manifest)
    pods = ", ".join(f"{spec['replicas']} {role}" for role, spec in specs.items())
    shape = describe_shape(manifest_shape(config, kube))
    header = [
        f"# Written by dtrain export k8s: {kind} {name}, {shape} in pods: {pods}.",
        f"# Start: kubectl apply -f FILE; watch: kubectl get {kind.lower()} {name}",
    ]
    return "\n".join(header) + "\n" + to_yaml(manifest)


def manifest_shape(config: JobConfig, kube: KubeJob) -> Shape:
    if kube.kind == "tfjob":
        ps = config.ps
        workers = ps.workers if ps is not None else job_shape(config.placement).ranks
        tasks = workers + (ps.ps_tasks + 1 + int(ps.evaluator) if ps is not None else 0)
        return Shape(tasks)
    return job_shape(config.placement)


def replica_specs(manifest: Mapping[str, Any]) -> dict[str, Any]:
    spec = manifest["spec"]
    key = next(k for k in spec if k.endswith("ReplicaSpecs"))
    return dict(spec[key])


def build_manifest(config: JobConfig, kube: KubeJob, env: Mapping[str, str]) -> dict[str, Any]:
    """The Kubeflow job for ``config``: ``env`` holds the resolved -x/--env-file values."""
    name = kube.name or default_name(config.command)
    check_names(kube, name)
    if not kube.image or any(c.isspace() or not c.isprintable() for c in kube.image):
        raise UsageError(
            f"--image {kube.image!r}: not an image name", "write e.g. --image repo/img:tag"
        )
    variables = env_entries(env, parse_secrets(kube.secrets, name))
    policy = restart_policy(kube, config.max_restarts)
    build = {"pytorchjob": pytorch_job, "tfjob": tf_job, "mpijob": mpi_job}[kube.kind]
    spec = build(config, kube.image, variables, policy)
    metadata = {"name": name, **({"namespace": kube.namespace} if kube.namespace else {})}
    manifest = {
        "apiVersion": "kubeflow.org/v2beta1" if kube.kind == "mpijob" else "kubeflow.org/v1",
        "kind": {"pytorchjob": "PyTorchJob", "tfjob": "TFJob", "mpijob": "MPIJob"}[kube.kind],
        "metadata": metadata,
        "spec": spec,
    }
    check_pod_names(manifest)
    return manifest


def pytorch_job(
    config: JobConfig, image: str, variables: list[dict[str, Any]], policy: str
) -> dict[str, Any]:
    """One pod per rank (the program as is), or with --nproc-per-node one pod per node
    running torchrun."""
    shape = job_shape(config.placement)
    if shape.nodes is not None and shape.per_node is None:
        raise UsageError(
            f"-np {shape.ranks} does not divide into --nnodes {shape.nodes} pods",
            "every pod runs as many ranks: give --nnodes and --nproc-per-node",
        )
    per_pod = shape.per_node or 1
    pods = shape.nodes or shape.ranks
    if per_pod > 1:
        command, own = torchrun_argv(config, pods, per_pod), []
    else:
        command = program_argv(config)
        own = [plain_env("LOCAL_RANK", "0"), plain_env("LOCAL_WORLD_SIZE", "1")]
    gpus = (config.placement.gpus_per_rank or 0) * per_pod
    pod = container("pytorch", image, command, [*own, *variables], gpus, config.env.workdir)
    specs = {"Master": replica(1, policy, pod)}
    if pods > 1:
        specs["Worker"] = replica(pods - 1, policy, pod)
    return {
        "nprocPerNode": str(per_pod),
        "runPolicy": run_policy(config),
        "pytorchReplicaSpecs": specs,
    }


def tf_job(
    config: JobConfig, image: str, variables: list[dict[str, Any]], policy: str
) -> dict[str, Any]:
    """One pod per TensorFlow task; every task runs the program, TF_CONFIG (the operator's)
    tells it its role.  As under ``dtrain ps``, the chief and ps tasks get no GPU."""
    gpus = config.placement.gpus_per_rank or 0
    workdir, ps = config.env.workdir, config.ps
    unbuffered = plain_env("PYTHONUNBUFFERED", "1")
    if ps is None:  # MultiWorkerMirroredStrategy: workers only (dtrain run --tf)
        pod = container(
            "tensorflow", image, program_argv(config), [unbuffered, *variables], gpus, workdir
        )
        return {
            "runPolicy": run_policy(config),
            "tfReplicaSpecs": {"Worker": replica(job_shape(config.placement).ranks, policy, pod)},
        }
    shared = [unbuffered, *(plain_env(k, v) for k, v in role_env(config).items()), *variables]
    no_gpu = [plain_env("CUDA_VISIBLE_DEVICES", ""), *shared]
    argv = program_argv(config)
    tasks = [
        ("Chief", 1, container("tensorflow", image, argv, no_gpu, 0, workdir)),
        ("Worker", ps.workers, container("tensorflow", image, argv, shared, gpus, workdir)),
        (
            "PS",
            ps.ps_tasks,
            container(
                "tensorflow",
                image,
                argv,
                shared if ps.ps_gpus else no_gpu,
                gpus if ps.ps_gpus else 0,
                workdir,
            ),
        ),
    ]
    if ps.evaluator:
        tasks.append(("Evaluator", 1, container("tensorflow", image, argv, shared, gpus, workdir)))
    specs = {role: replica(count, policy, pod) for role, count, pod in tasks}
    return {"runPolicy": run_policy(config), "tfReplicaSpecs": specs}


def mpi_job(
    config: JobConfig, image: str, variables: list[dict[str, Any]], policy: str
) -> dict[str, Any]:
    """A launcher pod running ``mpirun -np N``, and workers of K slots each running sshd;
    mpirun hands the variables to every rank by name (``-x NAME``)."""
    if policy not in ("Never", "OnFailure"):
        raise UsageError(
            f"--restart-policy {policy}: MPIJob takes Never or OnFailure",
            "use --restart-policy OnFailure",
        )
    shape = job_shape(config.placement)
    if shape.nodes is not None and shape.per_node is None:
        raise UsageError(
            f"-np {shape.ranks} does not divide into --nnodes {shape.nodes} workers",
            "every worker has as many slots: give --nnodes and --nproc-per-node",
        )
    slots = shape.per_node or 1
    launcher_env = [
        plain_env("PYTHONUNBUFFERED", "1"),
        *variables,
        plain_env("OMPI_ALLOW_RUN_AS_ROOT", "1"),  # images often run as root: Open MPI refuses it
        plain_env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ]
    forwarded = [v["name"] for v in launcher_env if not v["name"].startswith("OMPI_")]
    mpirun = ["mpirun", "-np", str(shape.ranks), "--map-by", "slot"]
    for name in forwarded:
        mpirun += ["-x", name]
    workdir = config.env.workdir
    launcher = container(
        "mpi-launcher", image, [*mpirun, *program_argv(config)], launcher_env, 0, workdir
    )
    worker = container(
        "mpi-worker", image, list(SSHD), [], (config.placement.gpus_per_rank or 0) * slots, workdir
    )
    return {
        "slotsPerWorker": slots,
        "runPolicy": run_policy(config),
        "mpiImplementation": "OpenMPI",
        "mpiReplicaSpecs": {
            "Launcher": replica(1, policy, launcher),
            "Worker": replica(shape.nodes or shape.ranks, policy, worker),
        },
    }


def program_argv(config: JobConfig) -> list[str]:
    """What a pod runs for one rank: COMMAND, through Python for a script or -m (escaped:
    Kubernetes would expand ``$(NAME)`` in it)."""
    python = config.python or DEFAULT_PYTHON
    if config.module:
        return escaped([python, "-m", *config.command])
    if not config.no_python and is_python_script(config.command[0], None):
        return escaped([python, *config.command])
    return escaped(config.command)


def torchrun_argv(config: JobConfig, nodes: int, per_node: int) -> list[str]:
    """torchrun in every pod: its node rank, the rendezvous and the world from the operator's
    variables (Kubernetes expands ``$(NAME)`` in a container's command)."""
    if config.python:
        raise UsageError(
            "--python with --nproc-per-node: torchrun starts the ranks with its own Python",
            "drop --python (use an image whose torchrun is the one you want)",
        )
    return [
        "torchrun",
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        "--node-rank=$(RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        *torchrun_program(config),
    ]


def torchrun_program(config: JobConfig) -> list[str]:
    """COMMAND as torchrun takes it: a script, ``-m module``, or ``--no-python program``."""
    words = list(config.command)
    if config.module:
        return ["-m", *words]
    if config.no_python:
        return ["--no-python", *escaped(words)]
    if INTERPRETER.match(words[0]):
        rest = words[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return escaped(rest)
        if not rest or rest[0].startswith("-"):
            raise UsageError(
                f"torchrun cannot run {shlex.join(words)!r}: it runs a script or -m module",
                "write e.g. python train.py, or -m package.module",
            )
        return escaped(rest)
    if is_python_script(words[0], None):
        return escaped(words)
    return ["--no-python", *escaped(words)]


def container(
    name: str,
    image: str,
    command: Sequence[str],
    variables: Sequence[Mapping[str, Any]],
    gpus: int,
    workdir: str | None,
) -> dict[str, Any]:
    """One container: its command as a list (never through a shell), its variables, GPUs."""
    result: dict[str, Any] = {"name": name, "image": image, "command": list(command)}
    if workdir:
        result["workingDir"] = workdir
    if variables:
        result["env"] = [dict(v) for v in variables]
    if gpus:
        result["resources"] = {"limits": {GPU_RESOURCE: gpus}}
    return result


def replica(count: int, policy: str, pod: Mapping[str, Any]) -> dict[str, Any]:
    return {"replicas": count, "restartPolicy": policy, "template": {"spec": {"containers": [pod]}}}


def run_policy(config: JobConfig) -> dict[str, Any]:
    """--max-restarts is the operator's retry budget; pods still running when the job ends go
    (finished ones stay, with their logs)."""
    return {"backoffLimit": config.max_restarts, "cleanPodPolicy": "Running"}


def restart_policy(kube: KubeJob, max_restarts: int) -> str:
    if kube.restart_policy is None:
        return "OnFailure" if max_restarts else "Never"
    for policy in RESTART_POLICIES:
        if policy.lower() == kube.restart_policy.lower():
            return policy
    raise UsageError(
        f"--restart-policy {kube.restart_policy}: not a Kubeflow restart policy",
        "use " + ", ".join(RESTART_POLICIES),
    )


def escaped(words: Sequence[str]) -> list[str]:
    """The user's words as they are: Kubernetes expands ``$(NAME)`` and ``$$`` in commands and
    variable values, ``$$`` keeps a ``$``."""
    return [word.replace("$", "$$") for word in words]


def plain_env(name: str, value: str) -> dict[str, str]:
    return {"name": name, "value": value.replace("$", "$$")}


def env_entries(
    env: Mapping[str, str], secrets: Mapping[str, tuple[str, str]]
) -> list[dict[str, Any]]:
    """The user's variables as given, then those read from Kubernetes secrets."""
    both = sorted(set(env) & set(secrets))
    if both:
        raise UsageError(
            f"{both[0]} is given a value (-x/--env-file) and a secret (--secret)",
            "drop one of them",
        )
    return [
        *(plain_env(name, value) for name, value in env.items()),
        *(
            {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
            for var, (secret, key) in secrets.items()
        ),
    ]


def parse_secrets(items: Sequence[str], job_name: str) -> dict[str, tuple[str, str]]:
    """``--secret VAR[=SECRET[:KEY]]``: VAR from key KEY (default VAR) of the Kubernetes
    secret SECRET (default: named as the job)."""
    found: dict[str, tuple[str, str]] = {}
    for item in items:
        var, _, ref = item.partition("=")
        secret, _, key = ref.partition(":")
        secret, key = secret or job_name, key or var
        if not ENV_NAME.match(var):
            raise UsageError(
                f"--secret {item!r}: {var!r} is not a valid variable name",
                "write --secret VAR, --secret VAR=SECRET or --secret VAR=SECRET:KEY",
            )
        if not SECRET_NAME.match(secret) or len(secret) > 253:
            raise UsageError(
                f"--secret {item!r}: {secret!r} is not a Kubernetes secret name",
                "secret names are lower-case letters, digits, '-' and '.'",
            )
        if not SECRET_KEY.match(key):
            raise UsageError(
                f"--secret {item!r}: {key!r} is not a key of a secret",
                "keys are letters, digits, '-', '_' and '.'",
            )
        found[var] = (secret, key)
    return found


def check_names(kube: KubeJob, name: str) -> None:
    if not DNS_LABEL.match(name):
        raise UsageError(
            f"--name {name!r}: Kubeflow job names are DNS labels",
            "use lower-case letters, digits and '-', starting with a letter",
        )
    if kube.namespace is not None and (
        not NAMESPACE.match(kube.namespace) or len(kube.namespace) > MAX_POD_NAME
    ):
        raise UsageError(
            f"--namespace {kube.namespace!r}: not a Kubernetes namespace name",
            "namespaces are lower-case letters, digits and '-'",
        )


def check_pod_names(manifest: Mapping[str, Any]) -> None:
    """The operators name pods (and services) NAME-ROLE-INDEX; the launcher pod of an MPIJob
    comes from a Job NAME-launcher (pod NAME-launcher-xxxxx)."""
    name = manifest["metadata"]["name"]
    names = [
        f"{name}-launcher-xxxxx"
        if role == "Launcher"
        else f"{name}-{role.lower()}-{spec['replicas'] - 1}"
        for role, spec in replica_specs(manifest).items()
    ]
    longest = max(names, key=len)
    if len(longest) > MAX_POD_NAME:
        raise UsageError(
            f"--name {name!r}: its pods' names ({longest}) would be longer than "
            f"{MAX_POD_NAME} characters",
            "use a shorter --name",
        )


def plain_values_notice(env: Mapping[str, str]) -> str | None:
    """What to tell the user about values written into the manifest in plain text."""
    if not env:
        return None
    names = ", ".join(sorted(env))
    return (
        f"dtrain: the manifest holds the values of {names} (from -x/--env-file) in plain "
        "text; keep secrets in a Kubernetes secret and name them with --secret NAME"
    )
