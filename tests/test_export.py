"""dtrain export: Slurm batch scripts and Kubeflow manifests.

Manifests are checked against the Kubeflow operators' CRD schemas (tests/data/kubeflow, with
where they came from) made strict (a field the API server would prune is an error), and
every pod template against Kubernetes' own schema (kubernetes-validate, strict).  Scripts
are run by bash as Slurm would start them, and submitted to the Slurm test cluster where
the fixture ``slurm_cluster`` exists.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.base.errors import UsageError
from launcher.cli.main import main
from launcher.core.config import PlacementConfig
from launcher.core.export import Shape, default_name, job_shape
from launcher.core.sbatch import slurm_time
from launcher.core.yamltext import to_yaml
from tests.conftest import REPO, child_env, run_dtrain
from tests.slurmcluster import SlurmCluster

DATA = Path(__file__).resolve().parent / "data" / "kubeflow"
CRDS = {  # kind -> (file, served version), every CRD the manifests of that kind must pass
    "PyTorchJob": [("kubeflow.org_pytorchjobs.yaml", "v1")],
    "TFJob": [("kubeflow.org_tfjobs.yaml", "v1")],
    "MPIJob": [("kubeflow.org_mpijobs.yaml", "v2beta1"), ("mpi-operator_crd.yaml", "v2beta1")],
}
K8S_VERSIONS = [kubernetes_validate.utils.all_versions()[0], kubernetes_validate.latest_version()]


def export(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """dtrain export ARGS through the real CLI, in this process: (exit code, stdout, stderr)."""
    code = main(["export", *args])
    out, err = capsys.readouterr()
    return code, out, err


def manifest_of(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = export(capsys, "k8s", *args)
    assert code == 0, err
    assert out.startswith("# Written by dtrain export k8s: ")
    loaded = yaml.safe_load(out)
    assert isinstance(loaded, dict)
    return loaded


# ------------------------------------------------------------------- shapes, names, times


@pytest.mark.parametrize(
    ("np", "nnodes", "per_node", "shape"),
    [
        (None, None, None, Shape(1)),
        (8, None, None, Shape(8)),
        (None, 2, None, Shape(2, 2, 1)),
        (8, 2, None, Shape(8, 2, 4)),
        (7, 2, None, Shape(7, 2, None)),
        (None, None, 4, Shape(4, 1, 4)),
        (None, 2, 4, Shape(8, 2, 4)),
        (8, None, 4, Shape(8, 2, 4)),
        (8, 2, 4, Shape(8, 2, 4)),
    ],
)
def test_shape_from_any_two_of_np_nnodes_and_per_node(
    np: int | None, nnodes: int | None, per_node: int | None, shape: Shape
) -> None:
    placement = PlacementConfig(np=np, nnodes=nnodes, nproc_per_node=per_node)
    assert job_shape(placement) == shape


@pytest.mark.parametrize(
    ("np", "nnodes", "per_node", "message"),
    [
        (6, None, 4, "-np 6 is not 1 node(s) x --nproc-per-node 4"),
        (6, 2, 4, "-np 6 is not 2 node(s) x --nproc-per-node 4"),
        (1, 2, None, "-np 1 is fewer ranks than --nnodes 2"),
        (0, None, None, "-np 0: must be at least 1"),
        (None, 0, None, "--nnodes 0: must be at least 1"),
        (None, 2, "gpu", "--nproc-per-node gpu: an exported job needs a number"),
    ],
)
def test_shapes_that_do_not_fit(
    np: int | None, nnodes: int | None, per_node: Any, message: str
) -> None:
    with pytest.raises(UsageError) as caught:
        job_shape(PlacementConfig(np=np, nnodes=nnodes, nproc_per_node=per_node))
    assert caught.value.message.startswith(message)


@pytest.mark.parametrize(
    ("command", "name"),
    [
        (["python", "train.py"], "train"),
        (["train.py", "--lr", "1"], "train"),
        (["/usr/bin/python3.11", "-u", "src/Train_Model.py"], "train-model"),
        (["python", "-m", "pkg.mod"], "pkg-mod"),
        (["./run.sh"], "run-sh"),
        (["python", "3d_unet.py"], "d-unet"),
        (["python", "-c", "print(1)"], "dtrain-job"),
        (["x" * 80], "x" * 40),
    ],
)
def test_default_names_are_dns_labels(command: list[str], name: str) -> None:
    assert default_name(command) == name


@pytest.mark.parametrize(
    ("given", "slurm"),
    [
        ("90", "90"),
        ("1:30:00", "1:30:00"),
        ("2-12", "2-12"),
        ("2-12:30:00", "2-12:30:00"),
        ("unlimited", "UNLIMITED"),
        ("30m", "00:30:00"),
        ("12h", "12:00:00"),
        ("36h", "1-12:00:00"),
        ("2d", "2-00:00:00"),
        ("20s", "00:01:00"),  # Slurm counts minutes: a shorter limit rounds up to one
    ],
)
def test_time_limits_in_slurm_form(given: str, slurm: str) -> None:
    assert slurm_time(given) == slurm


# -------------------------------------------------------------------------------- Slurm


def test_sbatch_script_for_nodes_and_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = export(
        capsys,
        "slurm",
        "-N", "2", "--ntasks-per-node", "4", "--gpus-per-rank", "1",
        "-t", "2h", "-p", "gpu", "-A", "proj", "--sbatch=--mem=64G",
        "-x", "MODE=it's $fine", "-x", "HOME", "--env-file", "run.env",
        "--max-restarts", "2", "--workdir", "/data/run",
        "python", "train.py", "--lr", "0.1 x",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "#!/bin/bash",
        "# Written by dtrain export slurm: 8 ranks (2 nodes x 4). Submit: sbatch FILE",
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --time=02:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --output=train-%j.out",
        "#SBATCH --chdir=/data/run",
        "#SBATCH --mem=64G",
        "set -eu",
        "export MODE='it'\"'\"'s $fine'",
        'exec dtrain run -np "$SLURM_NTASKS" --gpus-per-rank 1 --env-file run.env -x MODE -x HOME'
        " --max-restarts 2 python train.py --lr '0.1 x'",
    ]


@pytest.mark.parametrize(
    ("args", "layout"),
    [
        (["-np", "6"], ["#SBATCH --ntasks=6"]),
        (["-np", "7", "-N", "2"], ["#SBATCH --nodes=2", "#SBATCH --ntasks=7"]),
        (["-N", "3"], ["#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1"]),
        (["-np", "6", "--gpus-per-rank", "2"], ["#SBATCH --ntasks=6", "#SBATCH --gpus-per-task=2"]),
        (
            ["--nnodes", "2", "--nproc-per-node", "2"],
            ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2"],
        ),
    ],
)
def test_sbatch_layouts(
    capsys: pytest.CaptureFixture[str], args: list[str], layout: list[str]
) -> None:
    code, out, err = export(capsys, "slurm", *args, "train.py")
    assert code == 0, err
    lines = out.splitlines()
    assert [
        line for line in lines if re.match(r"#SBATCH --(nodes|ntasks|gres|gpus)", line)
    ] == layout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-t", "soon"], "dtrain: error: --time 'soon': not a time limit (hint: write minutes"),
        (["-p", "gpu long"], "dtrain: error: --partition 'gpu long': #SBATCH lines take no blanks"),
        (["-J", "a\nb"], "dtrain: error: --job-name 'a\\nb': #SBATCH lines take no blanks"),
        (["--sbatch", "mem=1G"], "dtrain: error: --sbatch 'mem=1G': expected one sbatch option"),
        (["-x", "1BAD=x"], "dtrain: error: -x '1BAD=x': '1BAD' is not a valid variable name"),
        (["--nproc-per-node", "auto"], "dtrain: error: --nproc-per-node auto: an exported job"),
        (["--dtrain", "'unclosed"], 'dtrain: error: --dtrain "\'unclosed": No closing quotation'),
        (["-m", "--no-python"], "dtrain: error: -m/--module and --no-python both given"),
    ],
)
def test_sbatch_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = export(capsys, "slurm", *args, "train.py")
    assert (code, out) == (2, "")
    assert err.startswith(message) and err.count("\n") == 1, err


def test_sbatch_script_runs_under_bash_as_slurm_starts_it(tmp_path: Path) -> None:
    """The script's body is real bash and real dtrain: run it as sbatch would on the first
    node (SLURM_NTASKS set by the allocation), with dtrain started as this checkout's."""
    (tmp_path / "run.env").write_text("FROM_FILE='a b'\n")
    program = (
        "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " os.environ['MODE'], os.environ['FROM_FILE'], os.environ['COPIED'])"
    )
    made = run_dtrain(
        "export", "slurm", "-np", "2", "--dtrain", f"{sys.executable} -m launcher",
        "-x", "MODE=$x 'q'", "-x", "COPIED", "--env-file", "run.env",
        sys.executable, "-c", program,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(made.stdout)
    env = {**child_env(), "SLURM_NTASKS": "2", "COPIED": "at run time", "PYTHONPATH": str(REPO)}
    ran = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    for rank in (0, 1):
        assert f"[{rank}] rank {rank} of 2 $x 'q' a b at run time" in ran.stdout.splitlines()


def test_sbatch_on_the_slurm_test_cluster(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Submitted with sbatch --wait to the test cluster: every rank ran, on both nodes, and
    wrote to the output file the script names.  (The fixture is named, not looked up: the
    tests on the test hosts share one xdist worker, found by the fixtures they name.)"""
    cluster = slurm_cluster
    program = (
        "import os, socket; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],"
        " 'on', socket.gethostname())"
    )
    made = run_dtrain(
        "export", "slurm", "-N", "2", "--ntasks-per-node", "2", "-J", "exported",
        "--dtrain", f"{sys.executable} -m launcher", "-t", "5m", sys.executable, "-c", program,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    (tmp_path / "job.sbatch").write_text(made.stdout)
    env = {**child_env(), **cluster.env(), "PYTHONPATH": str(REPO)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--wait", "job.sbatch"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    output = tmp_path / f"exported-{job_id}.out"
    assert submitted.returncode == 0, (
        submitted.stderr,
        output.read_text() if output.exists() else "",
    )
    lines = output.read_text().splitlines()
    hosts = set()
    for rank in range(4):
        found = [ln for ln in lines if re.match(rf"\[{rank}@\S+\] rank {rank} of 4 on ", ln)]
        assert len(found) == 1, lines
        hosts.add(found[0].rsplit(" ", 1)[1])
    assert len(hosts) == 2, lines


# --------------------------------------------------------------------------- Kubernetes


def strict(schema: Any) -> Any:
    """The schema, refusing fields it does not name: the API server would prune them
    silently, which for a manifest we wrote is a mistake.  Subtrees left out of the stored
    CRDs (x-dtrain-elided: the pod template, checked with Kubernetes' own schema) and those
    that keep unknown fields take anything."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    named = "properties" in result and "additionalProperties" not in result
    if named and not result.get("x-kubernetes-preserve-unknown-fields"):
        result["additionalProperties"] = False
    return result


INTS = jsonschema.FormatChecker()


@INTS.checks("int32")
def is_int32(value: object) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


def crd_validator(file: str, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((DATA / file).read_text())
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    schema = strict(served["schema"]["openAPIV3Schema"])
    # The API server keeps these three on every object, named in the schema or not.
    implicit = {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}
    schema["properties"] = {**implicit, "metadata": {"type": "object"}, **schema["properties"]}
    return jsonschema.Draft7Validator(schema, format_checker=INTS)


def check_manifest(manifest: dict[str, Any]) -> None:
    """Valid for every stored CRD of its kind, and every pod template for Kubernetes."""
    group, version = manifest["apiVersion"].split("/")
    assert group == "kubeflow.org"
    for file, served in CRDS[manifest["kind"]]:
        assert served == version
        errors = [
            f"{list(e.path)}: {e.message}"
            for e in crd_validator(file, served).iter_errors(manifest)
        ]
        assert errors == [], file
    spec = manifest["spec"]
    replicas = next(value for key, value in spec.items() if key.endswith("ReplicaSpecs"))
    for role in replicas.values():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": manifest["metadata"],
            "template": role["template"],
        }
        for k8s in K8S_VERSIONS:
            kubernetes_validate.validate(template, k8s, strict=True)


EXPORTS = [
    ["--image", "img:1", "-np", "1", "train.py"],
    ["--image", "img:1", "-np", "8", "--gpus-per-rank", "1", "python", "train.py"],
    ["--image", "img", "--nnodes", "2", "--nproc-per-node", "4", "--gpus-per-rank", "2",
     "train.py"],
    ["--image", "img", "--nproc-per-node", "2", "-m", "pkg.train", "--steps", "10"],
    ["--image", "img", "-np", "2", "--max-restarts", "3", "--namespace", "ml", "--name", "r",
     "--secret", "TOKEN=hf-creds:token", "-x", "A=$(B)", "--workdir", "/w", "./run.sh"],
    ["--image", "img", "-np", "2", "--restart-policy", "exitcode", "train.py"],
    ["--kind", "tfjob", "--image", "img", "-np", "4", "train.py"],
    ["--kind", "tfjob", "--image", "img", "--workers", "3", "--ps", "2", "--evaluator",
     "--gpus-per-rank", "1", "train.py"],
    ["--kind", "tfjob", "--image", "img", "--workers", "2", "--ps", "1", "--ps-gpus",
     "--gpus-per-rank", "1", "-x", "A=1", "train.py"],
    ["--kind", "mpijob", "--image", "img", "-np", "8", "python", "train.py"],
    ["--kind", "mpijob", "--image", "img", "-np", "8", "--nproc-per-node", "4",
     "--gpus-per-rank", "1", "--max-restarts", "1", "--secret", "K", "train.py"],
]  # fmt: skip


@pytest.mark.parametrize("args", EXPORTS, ids=[" ".join(a) for a in EXPORTS])
def test_every_manifest_is_valid_for_the_crds_and_kubernetes(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    check_manifest(manifest_of(capsys, *args))


def test_the_checks_refuse_what_the_api_server_would_drop_or_reject(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The validators have teeth: a misspelt field, a wrong type, a bad pod."""
    manifest = manifest_of(capsys, "--image", "img", "-np", "2", "train.py")
    master = manifest["spec"]["pytorchReplicaSpecs"]["Master"]
    for broken in (
        {**master, "restartPolicys": "Never"},
        {**master, "replicas": "1"},
        {**master, "replicas": 2**31},
    ):
        bad = {**manifest, "spec": {**manifest["spec"], "pytorchReplicaSpecs": {"Master": broken}}}
        with pytest.raises(AssertionError):
            check_manifest(bad)
    container = master["template"]["spec"]["containers"][0]
    for wrong in ({**container, "commands": ["x"]}, {**container, "env": [{"value": "1"}]}):
        pod = {"spec": {"containers": [wrong]}}
        bad = {
            **manifest,
            "spec": {
                **manifest["spec"],
                "pytorchReplicaSpecs": {"Master": {**master, "template": pod}},
            },
        }
        with pytest.raises(kubernetes_validate.ValidationError):
            check_manifest(bad)
    mpi = manifest_of(capsys, "--kind", "mpijob", "--image", "img", "-np", "2", "train.py")
    mpi["spec"]["mpiReplicaSpecs"]["Launcher"]["replicas"] = 2  # the hand-written CRD: max 1
    with pytest.raises(AssertionError):
        check_manifest(mpi)


def pod(manifest: dict[str, Any], role: str) -> dict[str, Any]:
    spec = manifest["spec"]
    replicas = next(value for key, value in spec.items() if key.endswith("ReplicaSpecs"))
    container: dict[str, Any] = replicas[role]["template"]["spec"]["containers"][0]
    return container


def test_pytorchjob_one_pod_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_of(
        capsys,
        "--image",
        "img",
        "-np",
        "8",
        "--gpus-per-rank",
        "1",
        "python",
        "train.py",
        "--lr",
        "0.1",
    )
    rank = {
        "name": "pytorch",
        "image": "img",
        "command": ["python", "train.py", "--lr", "0.1"],
        "env": [{"name": "LOCAL_RANK", "value": "0"}, {"name": "LOCAL_WORLD_SIZE", "value": "1"}],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
    }

    def replica(count: int) -> dict[str, Any]:
        return {
            "replicas": count,
            "restartPolicy": "Never",
            "template": {"spec": {"containers": [rank]}},
        }

    assert manifest == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "train"},
        "spec": {
            "nprocPerNode": "1",
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": {"Master": replica(1), "Worker": replica(7)},
        },
    }


def test_pytorchjob_torchrun_per_pod(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_of(
        capsys, "--image", "img", "--nnodes", "2", "--nproc-per-node", "4", "--gpus-per-rank", "1",
        "--max-restarts", "2", "python", "train.py", "--note", "$(HOME) costs $$",
    )  # fmt: skip
    spec = manifest["spec"]
    assert spec["nprocPerNode"] == "4"
    assert spec["runPolicy"] == {"backoffLimit": 2, "cleanPodPolicy": "Running"}
    assert {role: r["replicas"] for role, r in spec["pytorchReplicaSpecs"].items()} == {
        "Master": 1,
        "Worker": 1,
    }
    assert {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()} == {"OnFailure"}
    for role in ("Master", "Worker"):
        assert pod(manifest, role) == {
            "name": "pytorch",
            "image": "img",
            "command": [
                "torchrun", "--nnodes=2", "--nproc-per-node=4", "--node-rank=$(RANK)",
                "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)",
                "train.py", "--note", "$$(HOME) costs $$$$",
            ],
            "resources": {"limits": {"nvidia.com/gpu": 4}},
        }  # fmt: skip


@pytest.mark.parametrize(
    ("command", "program"),
    [
        (["-m", "pkg.train", "--x"], ["-m", "pkg.train", "--x"]),
        (["python3", "-m", "pkg.train"], ["-m", "pkg.train"]),
        (["./run.sh", "a"], ["--no-python", "./run.sh", "a"]),
        (["--no-python", "train.py"], ["--no-python", "train.py"]),
    ],
)
def test_torchrun_takes_scripts_modules_and_programs(
    capsys: pytest.CaptureFixture[str], command: list[str], program: list[str]
) -> None:
    manifest = manifest_of(capsys, "--image", "img", "--nproc-per-node", "2", *command)
    assert pod(manifest, "Master")["command"][6:] == program


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a command word or variable value: ``$$`` is ``$``,
    ``$(NAME)`` a defined variable's value, anything else as it is."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]),
        text,
    )


def test_words_and_values_reach_the_program_as_typed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "run.env").write_text('FROM_FILE="x $(A) y"\nKEPT=1\n')
    monkeypatch.setenv("COPIED", "$HOME and $(RANK)")
    monkeypatch.chdir(tmp_path)
    typed = ["python", "-c", "import os; print($(RANK), '$$')"]
    code, out, err = export(
        capsys, "k8s", "--image", "img", "-np", "2", "-x", "COPIED", "-x", "KEPT=2",
        "--env-file", "run.env", "--secret", "TOKEN", *typed,
    )  # fmt: skip
    assert code == 0, err
    container = pod(yaml.safe_load(out), "Worker")
    variables = {"RANK": "1", "MASTER_ADDR": "train-master-0", "A": "a"}
    assert [expand(word, variables) for word in container["command"]] == typed
    values = {v["name"]: expand(v["value"], variables) for v in container["env"] if "value" in v}
    assert values == {
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "FROM_FILE": "x $(A) y",
        "KEPT": "2",
        "COPIED": "$HOME and $(RANK)",
    }
    assert container["env"][-1] == {
        "name": "TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "dtrain-job", "key": "TOKEN"}},
    }
    assert err == (
        "dtrain: the manifest holds the values of COPIED, FROM_FILE, KEPT (from -x/--env-file) "
        "in plain text; keep secrets in a Kubernetes secret and name them with --secret NAME\n"
    )


def test_tfjob_parameter_servers(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_of(
        capsys, "--kind", "tfjob", "--image", "img", "--workers", "3", "--ps", "2", "--evaluator",
        "--gpus-per-rank", "1", "--name", "tf", "train.py",
    )  # fmt: skip
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert {role: spec["replicas"] for role, spec in specs.items()} == {
        "Chief": 1,
        "Worker": 3,
        "PS": 2,
        "Evaluator": 1,
    }
    shared = [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "DTRAIN_NUM_PS", "value": "2"},
        {"name": "GRPC_FAIL_FAST", "value": "use_caller"},
    ]
    no_gpu = [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}, *shared]
    gpu = {"resources": {"limits": {"nvidia.com/gpu": 1}}}
    base = {"name": "tensorflow", "image": "img", "command": ["python3", "train.py"]}
    assert pod(manifest, "Chief") == {**base, "env": no_gpu}
    assert pod(manifest, "PS") == {**base, "env": no_gpu}
    assert pod(manifest, "Worker") == {**base, "env": shared, **gpu}
    assert pod(manifest, "Evaluator") == {**base, "env": shared, **gpu}


def test_tfjob_multi_worker(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_of(capsys, "--kind", "tfjob", "--image", "img", "-np", "4", "train.py")
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 4


def test_mpijob_launcher_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    manifest = manifest_of(
        capsys, "--kind", "mpijob", "--image", "img", "-np", "8", "--nproc-per-node", "4",
        "--gpus-per-rank", "1", "-x", "A=1", "--secret", "K=s", "python", "train.py",
    )  # fmt: skip
    spec = manifest["spec"]
    assert manifest["apiVersion"] == "kubeflow.org/v2beta1"
    assert (spec["slotsPerWorker"], spec["mpiImplementation"]) == (4, "OpenMPI")
    assert spec["mpiReplicaSpecs"]["Worker"]["replicas"] == 2
    assert pod(manifest, "Launcher")["command"] == [
        "mpirun", "-np", "8", "--map-by", "slot",
        "-x", "PYTHONUNBUFFERED", "-x", "A", "-x", "K", "python", "train.py",
    ]  # fmt: skip
    names = [v["name"] for v in pod(manifest, "Launcher")["env"]]
    assert names == [
        "PYTHONUNBUFFERED",
        "A",
        "K",
        "OMPI_ALLOW_RUN_AS_ROOT",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
    ]
    assert pod(manifest, "Worker") == {
        "name": "mpi-worker",
        "image": "img",
        "command": ["/usr/sbin/sshd", "-De"],
        "resources": {"limits": {"nvidia.com/gpu": 4}},
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--ps", "1"],
            "--ps is for --kind tfjob, not pytorchjob (hint: drop --ps, or use --kind tfjob)",
        ),
        (
            ["--kind", "tfjob", "--nproc-per-node", "2"],
            "--nproc-per-node is for --kind pytorchjob or mpijob",
        ),
        (["--kind", "tfjob", "--evaluator"], "--evaluator and --ps-gpus are for jobs with --ps"),
        (["--kind", "tfjob", "-np", "2", "--workers", "3"], "-np 2 and --workers 3 both given"),
        (
            ["--kind", "mpijob", "--restart-policy", "Always"],
            "--restart-policy Always: MPIJob takes",
        ),
        (["-np", "5", "--nnodes", "2"], "-np 5 does not divide into --nnodes 2 pods"),
        (["--name", "Train"], "--name 'Train': Kubeflow job names are DNS labels"),
        (
            ["--name", "a" * 55, "-np", "20"],
            f"--name '{'a' * 55}': its pods' names ({'a' * 55}-worker-18)",
        ),
        (["--namespace", "ML"], "--namespace 'ML': not a Kubernetes namespace name"),
        (
            ["--secret", "T=Bad_Name"],
            "--secret 'T=Bad_Name': 'Bad_Name' is not a Kubernetes secret",
        ),
        (
            ["--secret", "A", "-x", "A=1"],
            "A is given a value (-x/--env-file) and a secret (--secret)",
        ),
        (
            ["-x", "UNSET_FOR_SURE"],
            "-x UNSET_FOR_SURE: UNSET_FOR_SURE is not set in dtrain's environment",
        ),
        (["--env-file", "/no/such.env"], "--env-file /no/such.env: no such file"),
        (["--nproc-per-node", "2", "--python", "/p"], "--python with --nproc-per-node"),
        (["--nproc-per-node", "2", "--no-python", "python"], None),
        (["--nproc-per-node", "2", "python", "-u"], "torchrun cannot run 'python -u'"),
        (["--image", "a b"], "--image 'a b': not an image name"),
    ],
)
def test_manifest_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str | None
) -> None:
    image = [] if "--image" in args else ["--image", "img"]
    command = [] if args[-1] in ("python", "-u") else ["train.py"]
    code, out, err = export(capsys, "k8s", *image, *args, *command)
    if message is None:  # --no-python python: a program named python, through torchrun
        assert code == 0, err
        return
    assert (code, out) == (2, "")
    assert err.startswith(f"dtrain: error: {message}") and err.count("\n") == 1, err


def test_the_flags_offer_what_the_module_knows() -> None:
    from launcher.cli import exportcmd
    from launcher.core import manifest as module

    assert exportcmd.KUBE_KINDS == module.KINDS
    assert exportcmd.KUBE_RESTART_POLICIES == module.RESTART_POLICIES


def test_export_k8s_needs_an_image_and_a_known_kind() -> None:
    missing = run_dtrain("export", "k8s", "-np", "2", "train.py")
    assert missing.returncode == 2
    assert missing.stderr.startswith("dtrain: error: Missing option '--image'")
    unknown = run_dtrain("export", "k8s", "--kind", "rayjob", "--image", "i", "train.py")
    assert unknown.returncode == 2 and "'rayjob' is not one of" in unknown.stderr


# ---------------------------------------------------------------------------------- YAML


TRICKY = [
    "",
    "yes",
    "No",
    "on",
    "null",
    "~",
    "0",
    "1:20",
    "0x1F",
    "1e3",
    ".inf",
    "2001-12-14",
    "a: b",
    "- x",
    "#c",
    "a #b",
    "@x",
    "`x`",
    "'q'",
    '"dq"',
    "back\\slash",
    "tab\tnew\nline\rcr",
    "\x00\x07\x1b\x7f\x85\xa0",
    "\u2028\u2029\ufeff\ufffe",
    "émoji 🎉 中文",
    " lead",
    "trail ",
    "$(X) $$",
    "nvidia.com/gpu",
]


@pytest.mark.parametrize("text", TRICKY)
def test_yaml_strings_come_back_as_written(text: str) -> None:
    value = {text: [text, {"k": text}], "n": 3, "t": True, "z": None, "e": [], "d": {}}
    assert yaml.safe_load(to_yaml(value)) == value


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=30), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON)
def test_yaml_round_trip(value: Any) -> None:
    assert yaml.safe_load(to_yaml(value)) == value
