"""The command line: dry runs, `dtrain hosts`, GPU binding, and one-line errors."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.command import LaunchSpec
from launcher.core.hosts import Host
from launcher.view.lineviews import LineView
from tests.conftest import REPO, child_env, dtrain_in_process, py, run_dtrain, tagged


def test_dry_run_json_is_the_plan() -> None:
    result = dtrain_in_process(
        "run",
        "--dry-run",
        "--json",
        "-np",
        "8",
        "-H",
        "a:4,b:4",
        "python",
        "train.py",
        "--lr",
        "0.1",
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [(e["rank"], e["host"], e["local_rank"], e["node_rank"]) for e in plan] == [
        (r, "a" if r < 4 else "b", r % 4, r // 4) for r in range(8)
    ]
    for entry in plan:
        assert entry["argv"] == ["python", "train.py", "--lr", "0.1"]
        env = entry["env"]
        assert env["RANK"] == str(entry["rank"]) and env["WORLD_SIZE"] == "8"
        assert env["MASTER_ADDR"] == "a" and env["LOCAL_WORLD_SIZE"] == "4"
        assert env["DTRAIN_JOB_ID"] == plan[0]["env"]["DTRAIN_JOB_ID"]


def test_dry_run_text_shows_commands_and_environment() -> None:
    result = dtrain_in_process(
        "run", "--dry-run", "-np", "2", "--map-by", "node", "-H", "a:2,b:2", "echo", "it's"
    )
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "rank 0  host a  local_rank 0  node_rank 0  gpus -"
    assert "  argv: echo 'it'\"'\"'s'" in lines
    assert "rank 1  host b  local_rank 0  node_rank 1  gpus -" in lines


def test_tf_config_for_every_rank() -> None:
    result = dtrain_in_process("run", "--dry-run", "--json", "--tf", "-np", "3", "echo")
    configs = [json.loads(e["env"]["TF_CONFIG"]) for e in json.loads(result.stdout)]
    workers = configs[0]["cluster"]["worker"]
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)


def fake_nvidia_smi(directory: Path, count: int) -> dict[str, str]:
    smi = directory / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(count)))
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = child_env()
    env["PATH"] = f"{directory}{os.pathsep}{env['PATH']}"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def test_gpus_found_by_nvidia_smi_are_bound_per_local_rank(mark: str, tmp_path: Path) -> None:
    env = fake_nvidia_smi(tmp_path, 4)
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    result = run_dtrain(
        "run",
        "-np",
        "2",
        "--gpus-per-rank",
        "2",
        "-x",
        f"DTRAIN_TEST_MARK={mark}",
        *py(code),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert (tagged(result.stdout, 0), tagged(result.stdout, 1)) == (["0,1"], ["2,3"])
    no_binding = dtrain_in_process(
        "run", "--dry-run", "--json", "-np", "2", "--no-gpu-binding", "true", env=env
    )
    assert all("CUDA_VISIBLE_DEVICES" not in e["env"] for e in json.loads(no_binding.stdout))
    too_many = dtrain_in_process("run", "-np", "5", "true", env=env)
    assert too_many.returncode == 2
    assert "host localhost has 4 GPU(s)" in too_many.stderr


def test_default_np_is_one_per_local_gpu(tmp_path: Path) -> None:
    result = dtrain_in_process(
        "run", "--dry-run", "--json", "true", env=fake_nvidia_smi(tmp_path, 3)
    )
    assert [e["env"]["CUDA_VISIBLE_DEVICES"] for e in json.loads(result.stdout)] == ["0", "1", "2"]


def test_hostfile_gpus_and_hosts_command(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nlocalhost slots=2 gpus=4,5\nnode9 slots=1\n")
    shown = dtrain_in_process("hosts", "--hostfile", str(hostfile))
    assert shown.returncode == 0
    assert shown.stdout.splitlines() == [
        "host       user  slots  max_slots  gpus",
        "localhost  -     2      -          4,5",
        "node9      -     1      -          -",
        "2 hosts, 3 slots",
    ]
    as_json = json.loads(dtrain_in_process("hosts", "-H", "a:2,root@b", "--json").stdout)
    assert as_json == [
        {"host": "a", "user": None, "slots": 2, "max_slots": None, "gpus": None},
        {"host": "b", "user": "root", "slots": 1, "max_slots": None, "gpus": None},
    ]
    plan = json.loads(
        dtrain_in_process(
            "run", "--dry-run", "--json", "--hostfile", str(hostfile), "-np", "2", "true"
        ).stdout
    )
    assert [e["gpus"] for e in plan] == [["4"], ["5"]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["run", "-np", "9", "-H", "a:4,b:4", "true"],
            "dtrain: error: -np 9 is more than the 8 slots of a:4, b:4 (hint: lower -np, add slots "
            "to the hosts, or pass --oversubscribe)",
        ),
        (
            ["run", "--hostfile", "/nonexistent/hosts", "true"],
            "dtrain: error: --hostfile /nonexistent/hosts: no such file (hint: check the path)",
        ),
        (["run", "-H", "a:x", "true"], "dtrain: error: -H 'a:x': slots must be a positive integer"),
        (["run", "--bogus", "true"], "dtrain: error: no such option --bogus (hint"),
        (["run", "-np", "two", "true"], "dtrain: error: -np two: not a whole number"),
        (["run", "-np", "2"], "dtrain: error: Missing argument 'COMMAND...'"),
        (["run", "--ranks", "x", "true"], "dtrain: error: --ranks 'x': not a list of ranks"),
        (["logs", "--since", "yesterday"], "dtrain: error: --since 'yesterday': not a duration"),
        (["stop", "no-such-job"], "dtrain: error: no job matching 'no-such-job'"),
        (
            ["run", "--tag-format", "{nope}", "true"],
            "dtrain: error: --tag-format '{nope}': unknown field {nope}",
        ),
        (
            ["run", "-x", "UNSET_VARIABLE_XYZ", "true"],
            "dtrain: error: -x UNSET_VARIABLE_XYZ: "
            "UNSET_VARIABLE_XYZ is not set in dtrain's environment",
        ),
        (
            ["run", "--env-file", "/nonexistent.env", "true"],
            "dtrain: error: --env-file /nonexistent.env: no such file",
        ),
        (["run", "-H", "a", "--hostfile", "h", "true"], "dtrain: error: both -H and --hostfile"),
        (
            ["run", "--workdir", "/nonexistent-dir", "true"],
            "dtrain: error: --workdir /nonexistent-dir: no such directory",
        ),
        (
            ["run", "--output-dir", "/etc/hostname", "true"],
            "dtrain: error: --output-dir /etc/hostname: cannot write there",
        ),
        (["run", "--tag-format", "[{rank:q}]", "true"], "dtrain: error: --tag-format '[{rank:q}]'"),
        (["nosuchcommand"], "dtrain: error: No such command 'nosuchcommand'"),
        (
            ["ps", "--framework", "torch", "--restart-workers", "1", "true"],
            "dtrain: error: --restart-workers is for --framework tf",
        ),
        (["ps", "--ps-hosts", " ", "true"], "dtrain: error: --ps-hosts: empty host list"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(
    args: list[str], message: str, tmp_path: Path
) -> None:
    job = tmp_path / "20260101-000000-abcdef"  # (a root with a job: else 'no jobs in ROOT')
    job.mkdir()
    (job / "meta.json").write_text("{}")
    result = dtrain_in_process(*args, env={"DTRAIN_JOB_DIR": str(tmp_path)})
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(message)
    assert "hint" in lines[0]
    assert "Traceback" not in result.stderr


def test_hostfile_error_names_file_and_line(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\n\nnode2 slots=x\n")
    result = dtrain_in_process("hosts", "--hostfile", str(hostfile))
    assert result.returncode == 2
    assert result.stderr.startswith(f"dtrain: error: {hostfile}:3: 'node2 slots=x': slots must be")


def test_every_documented_hostfile_parses() -> None:
    for path in sorted((REPO / "hostfiles").glob("*.txt")):
        assert dtrain_in_process("hosts", "--hostfile", str(path)).returncode == 0, path


def line_view(color: bool, tag: str = "[{rank}]") -> tuple[LineView, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    view = LineView(out, err, tag_format=tag, color=color, color_system="256", clock=lambda: 0.0)
    return view, out, err


def test_line_view_plain_and_coloured() -> None:
    spec = LaunchSpec(rank=3, host=Host("n1"), local_rank=1, argv=("x",), env={})
    plain, out, err = line_view(False)
    plain.show(spec, "stdout", [b"hello", b"\xff"])
    plain.show(spec, "stderr", [b"oops"])
    assert out.getvalue() == "[3] hello\n[3] \ufffd\n"
    assert err.getvalue() == "[3]<stderr> oops\n"
    coloured, out, _ = line_view(True)
    coloured.show(spec, "stdout", [b"hello"])
    assert out.getvalue().startswith("\x1b[") and out.getvalue().endswith("[3]\x1b[0m hello\n")


def test_piped_output_has_no_colour(mark: str) -> None:
    result = run_dtrain("run", "-np", "2", "-x", f"DTRAIN_TEST_MARK={mark}", "echo", "x")
    assert "\x1b[" not in result.stdout
    forced = run_dtrain("run", "-np", "1", "--color", "-x", f"DTRAIN_TEST_MARK={mark}", "echo", "x")
    assert "\x1b[" in forced.stdout


def test_unresolvable_host_fails_fast_naming_it() -> None:
    result = dtrain_in_process("run", "-H", "no-such-host.invalid", "--ssh-timeout", "3", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "dtrain: error: no-such-host.invalid: cannot resolve the host name "
        "(hint: check the name or its HostName in ~/.ssh/config)"
    ]


def test_bad_port_in_the_ssh_config_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text("Host far\n  HostName 198.18.0.250\n  Port abc\n")
    result = dtrain_in_process("run", "--ssh-config", str(config), "-H", "far", "true")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "dtrain: error: far: Port 'abc' in the ssh config is not a port number "
        "(hint: fix the Port line of that host in the ssh config)"
    ]


def test_proxy_jump_targets_parse() -> None:
    from launcher.transport.sshconfig import split_host_port

    assert split_host_port("bastion") == ("bastion", None)
    assert split_host_port("bastion:2222") == ("bastion", 2222)
    assert split_host_port("[fe80::1]:22") == ("fe80::1", 22)


def test_h_naming_a_file_reads_it_as_the_hostfile(tmp_path: Path, mark: str) -> None:
    (tmp_path / "hosts").write_text("localhost slots=8\n")
    code = "import os; print(os.environ['WORLD_SIZE'])"
    result = run_dtrain(
        "run", "-np", "8", "-H", "hosts", "-x", f"DTRAIN_TEST_MARK={mark}", *py(code), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert f"dtrain: -H hosts: reading the hostfile {tmp_path / 'hosts'}" in result.stderr
    assert sorted(tagged(result.stdout, r)[0] for r in range(8)) == ["8"] * 8
    listed = dtrain_in_process("hosts", "-H", "hosts", cwd=tmp_path)
    assert listed.stdout.splitlines()[-1] == "1 host, 8 slots"


def test_h_naming_both_a_file_and_a_host_is_refused(tmp_path: Path) -> None:
    (tmp_path / "localhost").write_text("node1 slots=2\n")
    result = dtrain_in_process("run", "--dry-run", "-H", "localhost", "true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "dtrain: error: -H localhost: both a file here and a host name (hint: pass --hostfile "
        "localhost to read the file, or -H localhost:1 for the host)"
    )
    with_slots = dtrain_in_process("run", "--dry-run", "-H", "localhost:1", "true", cwd=tmp_path)
    assert with_slots.returncode == 0, with_slots.stderr


def test_shell_completion_comes_from_click() -> None:
    env = {**child_env(), "_DTRAIN_COMPLETE": "bash_complete", "COMP_WORDS": "dtrain ru"}
    env["COMP_CWORD"] = "1"
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dtrain")], capture_output=True, text=True, env=env
    )
    assert result.stdout.strip() == "plain,run"
    source = subprocess.run(
        [str(Path(sys.executable).parent / "dtrain")],
        capture_output=True,
        text=True,
        env={**child_env(), "_DTRAIN_COMPLETE": "bash_source"},
    )
    assert "_dtrain_completion()" in source.stdout


def test_a_run_refused_in_process_leaves_no_agent_running() -> None:
    """The CLI's ``main`` called in process (the tests, a caller that goes on): a local run
    refused after its agent was started early closes that agent, instead of leaving it
    running until the caller exits."""

    def children() -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(int(entry))
        return found

    before = children()
    result = dtrain_in_process("run", "-np", "1", "no-such-program-xyz")
    assert result.returncode == 2 and "'no-such-program-xyz' not found" in result.stderr
    assert children() == before


def counted(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[object]:
    """Each call of ``module.name`` from any of dtrain's modules, loaded now or later (their
    ``from ... import name`` takes the counting one): the first argument of each."""
    import importlib

    real = getattr(importlib.import_module(module), name)
    calls: list[object] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return real(*args, **kwargs)

    for loaded in [m for key, m in sys.modules.items() if key.startswith("launcher")]:
        if getattr(loaded, name, None) is real:
            monkeypatch.setattr(loaded, name, counting)
    return calls


def test_a_job_validates_its_config_and_resolves_its_variables_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One check of the config and one resolution of -x and --env-file per job, whichever
    edge started it: the command line (whose local agent starts early with the variables)
    or the Python API."""
    import launcher

    env_file = tmp_path / "vars.env"
    env_file.write_text("FROM_FILE=1\n")
    checks = counted(monkeypatch, "launcher.core.config", "validate_config")
    resolutions = counted(monkeypatch, "launcher.core.env", "resolve_env_args")
    jobs = ("--job-dir", str(tmp_path / "jobs"))
    test = ("sh", "-c", "test $FOO$FROM_FILE = 1$BAR")
    for count, files in ((1, ()), (2, ("--env-file", str(env_file), "-x", "BAR=1"))):
        result = dtrain_in_process("run", "-np", "2", "-x", "FOO=1", *files, *jobs, *test)
        assert result.returncode == 0, result.stderr
        assert (len(checks), len(resolutions)) == (count, count)
    plan = launcher.launch(print, np=2, env={"FOO": "1"}, dry_run=True, no_config=True)
    assert len(plan) == 2
    assert (len(checks), len(resolutions)) == (3, 3)  # (its plan shows the variables)
