"""A real one-node Slurm on this machine for the tests (Debian's slurmctld, slurmd, munge).

The node is this machine itself ("localhost"), so a job's ranks run here, but every one
of them is started by ``srun`` as on a cluster.  Its configuration, state and logs live
in a temporary directory (``SLURM_CONF`` points there); the daemons listen on free
ports and are killed by ``stop()``.  munged is started if none answers.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

CONF = """ClusterName=dtraintest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AuthType=auth/munge
SchedulerType=sched/backfill
SelectType=select/cons_tres
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
NodeName=localhost CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root"
    for program in ("slurmctld", "slurmd", "srun", "munged", "munge"):
        if shutil.which(program) is None and not Path(f"/usr/sbin/{program}").exists():
            return f"Slurm is not installed ({program} missing): scripts/install-test-deps.sh"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OneNodeSlurm:
    def __init__(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="dtrain-slurm-"))
        self.daemons: list[subprocess.Popen[bytes]] = []

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.state / "slurm.conf")
        for name in [n for n in env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
            del env[name]  # not inside anyone's allocation
        return env

    def start(self) -> OneNodeSlurm:
        (self.state / "ctld").mkdir()
        text = CONF.format(ctld_port=free_port(), slurmd_port=free_port(), state=self.state)
        (self.state / "slurm.conf").write_text(text)
        (self.state / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self.ensure_munge()
        env = self.env()
        for argv in (["slurmctld", "-D", "-c", "-i"], ["slurmd", "-D", "-N", "localhost"]):
            self.daemons.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
            time.sleep(0.3)
        self.wait_idle()
        return self

    def ensure_munge(self) -> None:
        if subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], capture_output=True, check=False)
        deadline = time.monotonic() + 10
        while subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not start")
            time.sleep(0.1)

    def wait_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run("sinfo", "-h", "-o", "%t").stdout.strip()
            if out == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm node did not become idle: {(self.state / 'slurmctld.log')}")

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.env(), timeout=timeout, check=False
        )

    def steps(self) -> list[str]:
        """Running job steps (empty: nothing of any job runs)."""
        return self.run("squeue", "-h", "-s", "-o", "%i %j").stdout.split("\n")[:-1]

    def stop(self) -> None:
        self.run("scancel", "--user", "root")
        for daemon in self.daemons:
            daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        shutil.rmtree(self.state, ignore_errors=True)
