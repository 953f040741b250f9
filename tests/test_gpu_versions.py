"""``dtrain check``'s GPU stack: the probe's nvidia-smi queries and torch's CUDA build (a fake
nvidia-smi, a fake torch tree), the verdict across hosts as tables of rows, and the check
end to end on this machine and over the SSH test hosts (each answering its own fake)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from launcher.core.gpucheck import Finding, judge_gpu_stacks, torch_too_new, with_findings
from launcher.remote import probe
from tests.conftest import child_env, run_dtrain
from tests.testhosts import TestHosts

# Two GPUs on driver 580.95.05 (CUDA 13.0): GPU 0 used by a process, GPU 1 with 3 uncorrected
# ECC errors; on a host whose name ends in 3, driver 550.54.15 (CUDA 12.4), no process, no
# errors (so one check over the SSH test hosts sees one host differ).
FAKE_SMI = r"""#!/bin/sh
driver=580.95.05 cuda=13.0 ecc=3 app="GPU-5f1e, 4242, 1200, /usr/bin/python3, a name with a comma"
case "$(uname -n)" in *3) driver=550.54.15 cuda=12.4 ecc=0 app= ;; esac
case "$1" in
    --query-gpu=index,name,utilization.gpu,memory.used)
        echo "0, NVIDIA H200, 37, 1200"; echo "1, NVIDIA H200, 0, 0" ;;
    --query-gpu=*)
        echo "0, NVIDIA H200, GPU-5f1e, $driver, 1200, 143771, [N/A]"
        echo "1, NVIDIA H200, GPU-77aa, $driver, 0, 143771, $ecc" ;;
    --query-compute-apps=*) [ -n "$app" ] && echo "$app" ;;
    -q) printf '\n===NVSMI LOG===\n\nDriver Version   : %s\nCUDA Version   : %s\n' $driver $cuda ;;
esac
exit 0
"""


def fake_smi(directory: Path, text: str = FAKE_SMI) -> Path:
    directory.mkdir(exist_ok=True)
    smi = directory / "nvidia-smi"
    smi.write_text(text)
    smi.chmod(0o755)
    return smi


def test_probe_reads_the_gpu_stack_from_nvidia_smi(tmp_path: Path) -> None:
    gpus, details = probe.gpus_in_detail(str(fake_smi(tmp_path)))
    assert [g["index"] for g in gpus] == ["0", "1"]
    assert details["cuda"] == "13.0" and "error" not in details
    assert details["devices"] == [
        {
            "index": "0", "name": "NVIDIA H200", "uuid": "GPU-5f1e", "driver_version": "580.95.05",
            "memory.used": "1200", "memory.total": "143771",
            "ecc.errors.uncorrected.volatile.total": None,  # [N/A]: not reported
        },
        {
            "index": "1", "name": "NVIDIA H200", "uuid": "GPU-77aa", "driver_version": "580.95.05",
            "memory.used": "0", "memory.total": "143771",
            "ecc.errors.uncorrected.volatile.total": "3",
        },
    ]  # fmt: skip
    assert details["apps"] == [
        {
            "gpu_uuid": "GPU-5f1e", "pid": "4242", "used_memory": "1200",
            "process_name": "/usr/bin/python3, a name with a comma",
        }
    ]  # fmt: skip
    assert probe.gpus(str(fake_smi(tmp_path))) == gpus  # a job's probe: the first query only
    assert probe.gpus_in_detail(None)[1]["devices"] == []  # no nvidia-smi: no GPUs, as before


def test_a_failing_nvidia_smi_is_said_not_parsed(tmp_path: Path) -> None:
    said = "Failed to initialize NVML: Driver/library version mismatch"
    broken = f"#!/bin/sh\necho '{said}'\nexit 18\n"
    gpus, details = probe.gpus_in_detail(str(fake_smi(tmp_path, broken)))
    assert (gpus, details["devices"], details["apps"], details["cuda"]) == ([], [], [], None)
    assert details["error"] == said


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "__version__ = '2.11.0+cu130'\ndebug = False\ncuda: Optional[str] = '13.0'\n",
            {"version": "2.11.0+cu130", "cuda": "13.0"},
        ),
        (
            "__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip = None\n",
            {"version": "2.13.0+cpu", "cuda": None},
        ),
        ('__version__ = "1.13.1"\ncuda = "11.7"\n', {"version": "1.13.1", "cuda": "11.7"}),
        ("cudnn = '9'\n", {"version": None, "cuda": None}),
    ],
)
def test_torch_version_file_is_read_as_text(text: str, expected: dict[str, str | None]) -> None:
    assert probe.parse_torch_version(text) == expected


def test_torch_build_is_found_without_importing_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")  # must not run
    (package / "version.py").write_text("__version__ = '2.11.0'\ncuda = '13.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # (a torch an earlier test imported would be the one find_spec finds, not this one)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert probe.torch_build() == {"version": "2.11.0", "cuda": "13.0"}


def row(host: str, **changed: Any) -> dict[str, Any]:
    """A ``dtrain check`` row of a host that answered, as ``summarize_host`` makes it."""
    base: dict[str, Any] = {
        "host": host, "ok": True, "error": None, "versions": {"torch": "2.11.0+cu130"},
        "driver": "580.95.05", "driver_cuda": "13.0", "torch_cuda": "13.0",
        "gpus_in_use": [], "ecc_uncorrected": {"0": 0}, "nvidia_smi_error": None,
    }  # fmt: skip
    for key, value in changed.items():
        if key == "torch":
            base["versions"] = {"torch": value}
        else:
            base[key] = value
    return base


OLD = "580.65.06 (CUDA 13.0)"
NEW = "580.95.05 (CUDA 13.0)"
NCCL = "NCCL across them may fail"
TORCH = "torch.distributed across them may fail"


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([row("a"), row("b"), row("c")], []),
        (  # the classic: one host on another driver
            [row("a"), row("b"), row("c", driver="580.65.06")],
            [Finding(("c",), f"c has NVIDIA driver {OLD} where the other hosts have {NEW}; {NCCL}",
                     True)],
        ),
        (  # two of five: "most hosts"
            [row("a"), row("b", driver="580.65.06"), row("c"), row("d"),
             row("e", driver="580.65.06")],
            [Finding((h,), f"{h} has NVIDIA driver {OLD} where most hosts have {NEW}; {NCCL}", True)
             for h in ("b", "e")],
        ),
        (  # no majority: every host named in one line
            [row("a", driver="580.65.06"), row("b")],
            [Finding(("a", "b"), f"hosts differ in NVIDIA driver ({OLD} on a; {NEW} on b): {NCCL}",
                     True)],
        ),
        (  # no nvidia-smi on a host: nothing to compare there
            [row("a"), row("b", driver=None, driver_cuda=None, ecc_uncorrected={}),
             row("c")],
            [],
        ),
        (  # the same torch from two indexes (+cu130 or not) is the same build
            [row("a"), row("b", torch="2.11.0"), row("c")],
            [],
        ),
        (
            [row("a"), row("b", torch="2.10.0+cu130"), row("c")],
            [Finding(("b",), f"b has torch 2.10.0 where the other hosts have 2.11.0; {TORCH}",
                     True)],
        ),
        (
            [row("a"), row("b", torch="2.11.0+cpu", torch_cuda=None), row("c")],
            [Finding(("b",), "b has torch built for CPU only where the other hosts have CUDA 13.0; "
                     f"{TORCH}", True)],
        ),
        (  # no torch on a host: no build to compare
            [row("a"), row("b", torch=None, torch_cuda=None), row("c")],
            [],
        ),
        (  # a host that did not answer is not judged
            [row("a"), {"host": "b", "ok": False, "error": "no answer on port 22"}],
            [],
        ),
    ],
)  # fmt: skip
def test_hosts_whose_versions_differ_from_the_others_are_named(
    rows: list[dict[str, Any]], expected: list[Finding]
) -> None:
    assert judge_gpu_stacks(rows) == expected


@pytest.mark.parametrize(
    ("torch_cuda", "driver_cuda", "fails"),
    [
        ("13.0", "12.4", True),  # across major versions: the driver refuses it
        ("12.6", "12.4", False),  # minor version compatibility: runs, without PTX JIT
        ("12.4", "12.4", None),
        ("12.4", "13.0", None),
        (None, "12.4", None),  # a CPU build
        ("12.4", None, None),  # no driver here
    ],
)
def test_torch_built_for_a_newer_cuda_than_the_driver(
    torch_cuda: str | None, driver_cuda: str | None, fails: bool | None
) -> None:
    verdict = torch_too_new(torch_cuda, driver_cuda)
    assert (verdict and verdict[1]) == fails
    if verdict:
        said = f"torch is built for CUDA {torch_cuda} but the NVIDIA driver supports CUDA"
        assert verdict[0].startswith(f"{said} {driver_cuda}")


def test_each_hosts_own_problems_and_warnings() -> None:
    in_use = [{"gpu": "0", "pid": 4242, "process": "/usr/bin/python3", "memory_mib": 1200}]
    rows = [
        row("a", ecc_uncorrected={"0": 0, "1": 3, "2": 1}),
        row("b", gpus_in_use=in_use, ecc_uncorrected={}),
        row("c", driver="550.54.15", driver_cuda="12.4"),  # torch for CUDA 13 on a CUDA 12 driver
        row("d", nvidia_smi_error="Failed to initialize NVML: Driver/library version mismatch"),
        {"host": "e", "ok": False, "error": "no answer on port 22"},
    ]
    judged = {r["host"]: r for r in with_findings(rows)}
    assert judged["a"]["problems"] == [
        "a: GPU 1 has 3, GPU 2 has 1 uncorrected ECC errors; a job on them may crash or "
        "compute wrong results (hint: reset them, or --exclude a:1,2)"
    ]
    assert judged["b"]["warnings"] == [
        "b: GPU 0 in use by pid 4242 python3 (1200 MiB); ranks bound there share it "
        "(hint: --exclude b:0 leaves it out)"
    ]
    assert [p.split(";")[0] for p in judged["c"]["problems"]] == [
        "c has NVIDIA driver 550.54.15 (CUDA 12.4) where the other hosts have "
        "580.95.05 (CUDA 13.0)",
        "c: torch is built for CUDA 13.0 but the NVIDIA driver supports CUDA 12.4",
    ]
    assert judged["d"]["warnings"] == [
        "d: nvidia-smi failed: Failed to initialize NVML: Driver/library version mismatch"
    ]
    # problems fail a host, warnings do not
    assert [judged[h]["ok"] for h in "abcd"] == [False, True, False, True]
    assert judged["e"] == rows[4]


def check_env(tmp_path: Path) -> dict[str, str]:
    env = child_env()
    env["PATH"] = f"{fake_smi(tmp_path / 'bin').parent}{os.pathsep}{env['PATH']}"
    return env


def test_check_reports_the_gpu_stack_of_this_machine(tmp_path: Path) -> None:
    env = check_env(tmp_path)
    result = run_dtrain("check", "-H", "localhost", "--json", env=env)
    assert result.returncode == 1, result.stderr  # GPU 1's ECC errors fail the check
    (found,) = json.loads(result.stdout)
    assert (found["driver"], found["driver_cuda"], found["gpus"]) == ("580.95.05", "13.0", 2)
    assert found["ecc_uncorrected"] == {"1": 3}  # GPU 0's [N/A]: not reported
    assert found["gpus_in_use"] == [
        {"gpu": "0", "pid": 4242, "process": "/usr/bin/python3, a name with a comma",
         "memory_mib": 1200}
    ]  # fmt: skip
    assert "torch_cuda" in found and found["ok"] is False
    assert [m.split(";")[0] for m in found["problems"] + found["warnings"]] == [
        "localhost: GPU 1 has 3 uncorrected ECC errors",
        "localhost: GPU 0 in use by pid 4242 python3, a name with a comma (1200 MiB)",
    ]
    shown = run_dtrain("check", "-H", "localhost", env={**env, "COLUMNS": "80"})
    assert shown.returncode == 1
    assert all(len(line) <= 80 for line in shown.stdout.splitlines()), shown.stdout
    text = " ".join(shown.stdout.split())  # (lines wrapped at 80 columns, joined again)
    for said in (
        "driver 580.95.05 (CUDA 13.0)", "ECC errors 3", "in use by pid 4242 (GPU 0)",
        "dtrain: localhost: GPU 1 has 3 uncorrected ECC errors", "0 of 1 hosts ok",
    ):  # fmt: skip
        assert said in text, shown.stdout


@pytest.mark.sshhosts
def test_check_names_the_host_on_another_driver(ssh_hosts: TestHosts, tmp_path: Path) -> None:
    # The test hosts share this machine's files: the launcher's PATH, which the probe looks
    # through first (as the ranks' PATH starts), holds the fake; node3 answers 550.54.15.
    env = check_env(tmp_path)
    config = ["--ssh-config", str(ssh_hosts.ssh_config)]
    result = run_dtrain("check", *config, "-H", "node1,node2,node3", "--json", env=env)
    assert result.returncode == 1, result.stderr
    rows = {r["host"]: r for r in json.loads(result.stdout)}
    assert [rows[h]["driver"] for h in ("node1", "node2", "node3")] == ["580.95.05"] * 2 + [
        "550.54.15"
    ]
    assert rows["node3"]["problems"] == [
        "node3 has NVIDIA driver 550.54.15 (CUDA 12.4) where the other hosts have "
        f"580.95.05 (CUDA 13.0); {NCCL}"
    ]
    assert rows["node3"]["gpus_in_use"] == [] and rows["node3"]["warnings"] == []
    assert [w.split(";")[0] for w in rows["node1"]["warnings"]] == [
        "node1: GPU 0 in use by pid 4242 python3, a name with a comma (1200 MiB)"
    ]
    assert not rows["node1"]["ok"] and rows["node1"]["ecc_uncorrected"] == {"1": 3}
