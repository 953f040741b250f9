"""``dtrain export`` (the edge): the job written for a cluster's scheduler instead of run.

``dtrain export slurm`` prints an sbatch script (``core/sbatch.py`` writes it),
``dtrain export k8s`` a Kubeflow manifest (``core/manifest.py``); these are
their flags.
"""

from __future__ import annotations

import os
from typing import Any

import click

from launcher.cli.options import COMMAND, CONTEXT, COUNT, JOB_COMMAND, Decorator, F, option, stacked


def export_options(when: str, python: str, restarts: str) -> Decorator:
    """The flags ``dtrain run`` also has; ``when`` says when variables are read, ``python``
    the default interpreter, ``restarts`` what --max-restarts becomes."""
    return stacked(
        option(
            "-x exports",
            f"A variable for every rank; NAME alone copies it {when}.",
            multiple=True,
            metavar="NAME[=VALUE]",
        ),
        option(
            "--env-file env_files",
            f"Variables for every rank, dotenv syntax, read {when} (repeatable).",
            multiple=True,
            metavar="FILE",
        ),
        option("--gpus-per-rank", "GPUs for each rank.", type=click.IntRange(1), metavar="K"),
        option("--workdir", "Working directory of the ranks.", metavar="DIR"),
        option(
            "--python",
            f"Interpreter for a Python script COMMAND (default: {python}).",
            metavar="PATH",
        ),
        option("--no-python", "Run COMMAND as given, even train.py.", is_flag=True),
        option("-m --module", "COMMAND is a Python module: run python -m COMMAND.", is_flag=True),
        option("--max-restarts", restarts, type=click.IntRange(0), default=0, **COUNT),
    )


slurm_options = stacked(
    option(
        "-np --np np",
        "Number of ranks, one per Slurm task (default: nodes x tasks per node).",
        type=int,
        metavar="N",
    ),
    option("-N --nodes --nnodes nnodes", "Number of nodes.", type=int, metavar="N"),
    option("--ntasks-per-node --nproc-per-node nproc_per_node", "Ranks on each node.", metavar="K"),
    option("-t --time", "Time limit: minutes, H:MM:SS, D-HH, or 30m, 12h, 2d.", metavar="LIMIT"),
    option("-p --partition", "Slurm partition.", metavar="NAME"),
    option("-A --account", "Slurm account to charge.", metavar="NAME"),
    option("-J --job-name name", "Job name (default: after the program).", metavar="NAME"),
    option("-o --output", "Slurm's output file (default: NAME-%j.out).", metavar="FILE"),
    option(
        "--sbatch",
        "Another sbatch option for the script, e.g. --sbatch=--mem=64G (repeatable).",
        multiple=True,
        metavar="OPTION",
    ),
    option(
        "--dtrain",
        "How the nodes start dtrain.",
        default="dtrain",
        show_default=True,
        metavar="COMMAND",
    ),
    option("--tf tf_config", "Set TF_CONFIG with every rank a worker.", is_flag=True),
    option("--checkpoint-dir", "DTRAIN_CHECKPOINT_DIR of every rank.", metavar="DIR"),
)


# launcher.core.manifest's KINDS and RESTART_POLICIES (a test checks they agree): importing it here
# would slow every dtrain start.
KUBE_KINDS = ("pytorchjob", "tfjob", "mpijob")
KUBE_RESTART_POLICIES = ("Never", "OnFailure", "Always", "ExitCode")


def kube_options(command: F) -> F:
    """``dtrain export k8s``'s flags."""
    return stacked(
        option(
            "--kind",
            "The Kubeflow job: pytorchjob, tfjob or mpijob.",
            type=click.Choice(KUBE_KINDS, case_sensitive=False),
            default="pytorchjob",
            show_default=True,
        ),
        option("--image", "Container image with the program.", required=True, metavar="IMAGE"),
        option(
            "-np --np np",
            "Number of ranks (PyTorchJob: a pod each; TFJob: workers; MPIJob: mpirun -np).",
            type=int,
            metavar="N",
        ),
        option(
            "--nproc-per-node",
            "Ranks per pod: PyTorchJob runs torchrun in each pod; MPIJob: slots per worker.",
            metavar="K",
        ),
        option("--nnodes", "Number of pods (with --nproc-per-node).", type=int, metavar="N"),
        option("--workers", "TFJob: worker tasks.", type=click.IntRange(1), metavar="N"),
        option(
            "--ps ps_tasks",
            "TFJob: parameter-server tasks (and a chief).",
            type=click.IntRange(0),
            default=0,
            **COUNT,
        ),
        option("--evaluator", "TFJob: add an evaluator task.", is_flag=True),
        option("--ps-gpus", "TFJob: ps tasks get GPUs too.", is_flag=True),
        option("--name", "Job name (default: after the program).", metavar="NAME"),
        option("--namespace", "Namespace (default: kubectl's current one).", metavar="NS"),
        option(
            "--secret secrets",
            "Variable VAR from key KEY (default VAR) of Kubernetes secret SECRET (default: the "
            "job's name). Repeatable.",
            multiple=True,
            metavar="VAR[=SECRET[:KEY]]",
        ),
        option(
            "--restart-policy",
            "Never (default), OnFailure (default with --max-restarts), Always, ExitCode.",
            type=click.Choice(KUBE_RESTART_POLICIES, case_sensitive=False),
            metavar="POLICY",
        ),
    )(command)


@click.group("export", context_settings=CONTEXT)
def export_group() -> None:
    """Write the job for a cluster's scheduler instead of running it (docs/clusters.md).

    \b
      dtrain export slurm -N 2 --ntasks-per-node 4 python train.py > job.sbatch
      dtrain export k8s --image IMG -np 8 --gpus-per-rank 1 train.py > job.yaml
    """


@export_group.command("slurm", context_settings=JOB_COMMAND)
@slurm_options
@export_options(
    "when the job runs",
    "dtrain's choice on the nodes",
    "Start the whole job again after a failure, at most N times (dtrain run's restarts).",
)
@COMMAND
def export_slurm(**options: Any) -> int:
    """Print an sbatch script that runs COMMAND with dtrain run, one rank per Slurm task.

    \b
      dtrain export slurm -N 2 --ntasks-per-node 4 python train.py > job.sbatch
      dtrain export slurm -N 2 --ntasks-per-node 4 --gpus-per-rank 1 -t 2h train.py
      sbatch job.sbatch
    """
    from launcher.core.sbatch import render_sbatch, slurm_config

    click.echo(render_sbatch(*slurm_config(options)), nl=False)
    return 0


@export_group.command("k8s", context_settings=JOB_COMMAND)
@kube_options
@export_options(
    "now, into the manifest",
    "python3",
    "The operator's retries before the job fails (runPolicy.backoffLimit).",
)
@COMMAND
def export_k8s(**options: Any) -> int:
    """Print a Kubeflow manifest (PyTorchJob, TFJob, MPIJob) that runs COMMAND.

    \b
      dtrain export k8s --image IMG -np 8 --gpus-per-rank 1 train.py > job.yaml
      dtrain export k8s --image IMG --nnodes 2 --nproc-per-node 4 python train.py
      dtrain export k8s --kind tfjob --workers 3 --ps 1 --image IMG train.py
      dtrain export k8s --kind mpijob --image IMG -np 8 python train.py
      kubectl apply -f job.yaml
    """
    from launcher.core.manifest import kube_config, plain_values_notice, render_manifest
    from launcher.run.early import job_variables

    config, kube = kube_config(options)
    env = job_variables(config, os.environ)
    click.echo(render_manifest(config, kube, env), nl=False)
    notice = plain_values_notice(env)
    if notice is not None:
        click.echo(notice, err=True)
    return 0
