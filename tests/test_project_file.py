"""The project file (issue 26, section 2): ``dtrain.toml`` or ``pyproject.toml``'s
``[tool.dtrain]``, found above the working directory, under the command line; ``-x PATTERN``.

End to end: ``dtrain`` in a temporary folder tree, a project file two folders up, plans read
back from ``--dry-run --json``: what dtrain decides (a plan, a refusal, a dry run's lines)
through the CLI's ``main`` in this process, and a real ``dtrain`` (a subprocess) where a job's
ranks must see a file's value or its first line says whose settings steer it.  Pure parts
(finding a key's line, laying the file under the command line): tables of whole values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import launcher
from launcher.core.projectfile import (
    Applied,
    Key,
    Setting,
    Source,
    check_file,
    key_line,
    settings_for,
    settle,
)
from tests.conftest import DTRAIN, JOBS, child_env, dtrain_in_process
from tests.otheruser import OtherUser

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project folder; the tests run two folders below it (``project/src/deep``)."""
    (tmp_path / "project" / "src" / "deep").mkdir(parents=True)
    return tmp_path / "project"


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def dtrain(
    project: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``dtrain ARGS`` two folders below ``project``, in this process: for what dtrain says
    or decides (a plan, a refusal, a dry run), not for a job that starts ranks."""
    return dtrain_in_process(
        *args, env={**child_env(), **(env or {})}, cwd=project / "src" / "deep"
    )


def dtrain_job(
    project: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``dtrain ARGS`` run two folders below ``project``: a real ``dtrain`` (a subprocess),
    for a job whose ranks start."""
    return subprocess.run(
        [*DTRAIN, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**child_env(), **(env or {})},
        cwd=project / "src" / "deep",
    )


def plan(project: Path, *args: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The ranks ``dtrain run --dry-run --json ARGS true`` plans (it must succeed)."""
    done = dtrain(project, "run", "--dry-run", "--json", *args, "true", env=env)
    assert done.returncode == 0, done.stderr
    ranks: list[dict[str, Any]] = json.loads(done.stdout)
    return ranks


def hosts_of(ranks: list[dict[str, Any]]) -> list[str]:
    return [rank["host"] for rank in ranks]


def the_error(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refused command line (exit 2, nothing else said)."""
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("dtrain: error: "), lines[0]
    return lines[0]


def test_a_file_two_folders_up_gives_run_its_options(project: Path) -> None:
    write(
        project,
        "dtrain.toml",
        """
        [defaults]
        env = ["FROM_FILE", "NCCL_DEBUG=INFO"]

        [run]
        np = 3
        hosts = "localhost:4"
        """,
    )
    ranks = plan(project, env={"FROM_FILE": "value-from-the-environment"})
    assert len(ranks) == 3
    assert ranks[0]["env"]["NCCL_DEBUG"] == "INFO"
    assert ranks[0]["env_hidden"] == ["FROM_FILE"]  # (its value came from the environment)
    without = plan(project, "--no-config")
    assert len(without) == 1 and "NCCL_DEBUG" not in without[0]["env"]


def test_relative_paths_are_the_files_folder(project: Path) -> None:
    write(project, "hosts", "nodeA slots=2\nnodeB slots=2\n")
    write(project, "vars.env", "FROM_ENV_FILE=1\n")
    write(
        project,
        "dtrain.toml",
        """
        [run]
        hostfile = "hosts"
        env_file = "vars.env"
        """,
    )
    ranks = plan(project)
    assert hosts_of(ranks) == ["nodeA", "nodeA", "nodeB", "nodeB"]
    assert ranks[0]["env_hidden"] == ["FROM_ENV_FILE"]


def test_pyproject_tool_dtrain_and_which_file_is_nearest(project: Path) -> None:
    write(
        project,
        "pyproject.toml",
        """
        [project]
        name = "demo"

        [tool.dtrain.run]
        np = 2
        """,
    )
    assert len(plan(project)) == 2
    # A pyproject.toml without [tool.dtrain] nearer: the search goes on above it (as ruff's).
    write(project / "src", "pyproject.toml", '[project]\nname = "inner"\n')
    assert len(plan(project)) == 2
    # dtrain.toml beside a pyproject.toml with [tool.dtrain]: dtrain.toml wins, and says so.
    write(project, "dtrain.toml", "[run]\nnp = 4\n")
    assert len(plan(project)) == 4
    told = dtrain(project, "run", "--dry-run", "true").stderr
    assert "(../../pyproject.toml beside it: its [tool.dtrain] is not read)" in told
    # The nearest file wins over one further up.
    write(project / "src", "dtrain.toml", "[run]\nnp = 1\n")
    assert len(plan(project)) == 1


def test_the_command_line_wins_even_with_the_default_value(project: Path) -> None:
    write(
        project,
        "dtrain.toml",
        """
        [run]
        np = 2
        map_by = "node"
        hosts = "a:2,b:2"
        """,
    )
    assert hosts_of(plan(project)) == ["a", "b"]  # the file's round robin
    assert hosts_of(plan(project, "--map-by", "slot")) == ["a", "a"]  # given: wins
    assert hosts_of(plan(project, "-np", "3")) == ["a", "b", "a"]
    # Other launchers' spellings too, with no "both given" against the file's -np:
    assert len(plan(project, "-n", "4")) == 4
    assert len(plan(project, "--nproc_per_node", "1")) == 2  # replaces the file's np too
    # The command line's hosts replace the file's, whichever way they are given.
    assert hosts_of(plan(project, "-H", "c:1,d:1")) == ["c", "d"]
    write(project, "hosts", "e slots=2\n")
    assert hosts_of(plan(project, "--hostfile", str(project / "hosts"))) == ["e", "e"]


def test_env_adds_the_command_lines_to_the_files(project: Path) -> None:
    write(project, "dtrain.toml", '[run]\nenv = ["A=file", "B=file"]\n')
    ranks = plan(project, "-x", "B=command-line", "-x", "C=command-line")
    env = ranks[0]["env"]
    assert (env["A"], env["B"], env["C"]) == ("file", "command-line", "command-line")


def test_a_name_in_the_files_env_that_is_not_set_is_left_out_with_a_note(
    project: Path,
) -> None:
    """A project's env names variables some shells do not have (PYTHONPATH): not an error, as
    an unset ``-x NAME`` on the command line is, but a note naming the file's line."""
    write(project, "dtrain.toml", '[defaults]\nenv = ["SET_HERE", "UNSET_HERE", "A=1"]\n')
    done = dtrain(project, "run", "--dry-run", "--json", "true", env={"SET_HERE": "yes"})
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)[0]["env"]
    assert env["A"] == "1" and "UNSET_HERE" not in env and "SET_HERE" in json.dumps(done.stdout)
    assert (
        "dtrain: note: ../../dtrain.toml:2: env UNSET_HERE not set here: not passed"
        in done.stderr.splitlines()
    )
    unset = dtrain(project, "run", "--dry-run", "-x", "UNSET_HERE", "true")
    assert unset.returncode == 2  # typed on the command line: still an error


def test_tool_dtrain_as_a_dotted_key_under_tool(project: Path) -> None:
    write(project, "pyproject.toml", "[tool]\ndtrain = { run = { np = 3 } }\n")
    assert len(plan(project)) == 3


def test_x_pattern_copies_a_family_of_variables(project: Path) -> None:
    family = {"FAMILY_ONE": "1", "FAMILY_TWO": "2", "FAMILYX": "no", "OTHER_FAMILY_": "no"}
    ranks = plan(project, "-x", "FAMILY_*", env=family)
    assert ranks[0]["env_hidden"] == ["FAMILY_ONE", "FAMILY_TWO"]
    write(project, "dtrain.toml", '[defaults]\nenv = ["FAMILY_?NE"]\n')
    assert plan(project, env=family)[0]["env_hidden"] == ["FAMILY_ONE"]
    assert "env_hidden" not in plan(project)[0]  # a family may be empty: no error


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[run]\nnp = 2\nnmp = 3\n",
            "../../dtrain.toml:3: [run] nmp: not an option of dtrain run (hint: did you mean np?)",
        ),
        (
            "[run]\nmax_restart = 3\n",
            "../../dtrain.toml:2: [run] max_restart: not an option of dtrain run "
            "(hint: did you mean max_restarts?)",
        ),
        ("[rnu]\nnp = 3\n", "../../dtrain.toml:1: no table [rnu] in a project file"),
        (
            '[run]\nnp = "eight"\n',
            '../../dtrain.toml:2: [run] np = "eight": expected a whole number '
            "(hint: write e.g. np = 2)",
        ),
        ("[run]\nhosts = 4\n", "../../dtrain.toml:2: [run] hosts = 4: expected a string"),
        ("\n[ps]\nnp = 3\n", "../../dtrain.toml:3: np is not an option of dtrain ps"),
        (
            '[run]\nbind_to = "cores"\n',
            '../../dtrain.toml:2: [run] bind_to = "cores": not one of none, core, socket '
            '(hint: did you mean bind_to = "core"?)',
        ),
        ("[run]\ngrace = nan\n", "../../dtrain.toml:2: [run] grace = nan: not a finite number"),
        ("[run]\nnp = \n", "../../dtrain.toml:2:6: Invalid value (hint: fix the TOML syntax"),
        ("np = 3\n", "../../dtrain.toml:1: np is outside the tables of commands"),
        ("[run]\ndry_run = true\n", "../../dtrain.toml:2: dry_run is a choice for one run"),
        ('[run]\nenv = ["A-B"]\n', "../../dtrain.toml:2: [run] env: 'A-B' is not a variable"),
        # (a mistake in [sweep] is said by dtrain run too: the whole file is checked)
        ("[sweep]\nmax_parallel = 1.5\n", "../../dtrain.toml:2: [sweep] max_parallel = 1.5: exp"),
        (
            "[run]\nmax_restarts = -1\n",
            "../../dtrain.toml:2: [run] max_restarts = -1: must be at least 0 "
            "(hint: give max_restarts = 0 or more)",
        ),
        (  # a share, not a duration (it said "a number of seconds", e.g. 30)
            '[run]\nstraggler_ratio = "x"\n',
            '../../dtrain.toml:2: [run] straggler_ratio = "x": expected a number between 0 '
            "and 1 (hint: write e.g. straggler_ratio = 0.7)",
        ),
    ],
)
def test_a_mistake_in_the_file_is_one_line_with_its_line(
    project: Path, text: str, expected: str
) -> None:
    (project / "dtrain.toml").write_text(text)
    assert the_error(dtrain(project, "run", "true")).startswith("dtrain: error: " + expected)
    assert dtrain(project, "run", "--dry-run", "--no-config", "true").returncode == 0  # (not read)


def test_a_mistake_in_pyproject_names_its_table(project: Path) -> None:
    write(project, "pyproject.toml", '[project]\nname = "x"\n\n[tool.dtrain.run]\nnpp = 2\n')
    assert the_error(dtrain(project, "run", "true")).startswith(
        "dtrain: error: ../../pyproject.toml:5: [tool.dtrain.run] npp: not an option of "
        "dtrain run (hint: did you mean np?)"
    )


@pytest.mark.parametrize(
    "env",
    ['["WANDB_API_KEY=abc123"]', '{HF_TOKEN = "abc123"}', '"DB_PASSWORD=abc123"'],
)
def test_a_secret_in_the_file_is_refused(project: Path, env: str) -> None:
    (project / "dtrain.toml").write_text(f"[defaults]\nenv = {env}\n")
    line = the_error(dtrain(project, "run", "true"))
    assert "../../dtrain.toml:2: [defaults] env: " in line and "looks like a secret" in line
    assert "abc123" not in line
    assert "name it instead" in line


def test_dry_run_and_verbose_say_where_each_value_came_from(project: Path) -> None:
    write(
        project,
        "dtrain.toml",
        """
        [defaults]
        env = ["SECRET_FROM_HERE"]
        env_file = "vars.env"

        [run]
        np = 2
        hostfile = "hosts"
        """,
    )
    write(project, "vars.env", "FROM_ENV_FILE=hidden-value-2\n")
    env = {"SECRET_FROM_HERE": "hidden-value-1"}
    done = dtrain(project, "run", "--dry-run", "-H", "localhost:2", "true", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[:5] == [
        "dtrain: project file ../../dtrain.toml: [defaults] and [run] (--no-config ignores it)",
        'dtrain:   env = ["SECRET_FROM_HERE"]  (../../dtrain.toml:2 [defaults])',
        'dtrain:   env_file = "vars.env"  (../../dtrain.toml:3 [defaults])',
        "dtrain:   np = 2  (../../dtrain.toml:6 [run])",
        'dtrain:   hostfile = "hosts"  (../../dtrain.toml:7 [run]): the command line\'s -H instead',
    ]
    assert "hidden-value" not in done.stdout + done.stderr
    assert "  env:  SECRET_FROM_HERE=...  (from dtrain's environment or an env file)" in (
        done.stdout
    )
    verbose = dtrain_job(project, "run", "--verbose", "-H", "localhost:2", "true", env=env)
    assert verbose.returncode == 0, verbose.stderr
    assert "dtrain:   np = 2  (../../dtrain.toml:6 [run])" in verbose.stderr
    assert "hidden-value" not in verbose.stdout + verbose.stderr
    quiet = dtrain_job(project, "run", "-H", "localhost:2", "true", env=env)
    assert "project file" not in quiet.stderr  # the values: said only when asked
    # ...but whose settings steer the job is its first line, every time (issue 33).
    assert (
        quiet.stderr.splitlines()[0]
        == "dtrain: settings from ../../dtrain.toml (env, env_file, np)"
    )
    replaced = dtrain_job(
        project,
        "run",
        "-H",
        "localhost:1",
        "-np",
        "1",
        "--env-file",
        "/dev/null",
        "-x",
        "A=1",
        "true",
        env={**env, "FROM_ENV_FILE": "x"},
    )
    assert (
        replaced.stderr.splitlines()[0] == "dtrain: settings from ../../dtrain.toml (env, env_file)"
    )


def test_ps_and_sweep_read_their_tables_and_the_defaults(project: Path) -> None:
    write(
        project,
        "dtrain.toml",
        """
        [defaults]
        np = 3             # dtrain ps has no -np: not its key, and no mistake
        plain = true

        [ps]
        workers = 3

        [sweep]
        grid = ["lr=0.1,0.01"]
        """,
    )
    ps = dtrain(project, "ps", "--dry-run", "--json", "true")
    assert ps.returncode == 0, ps.stderr
    roles = [rank["role"] for rank in json.loads(ps.stdout)]
    assert roles.count("worker") == 3
    sweep = dtrain(project, "sweep", "--dry-run", "--json", "true", "{lr}")
    assert sweep.returncode == 0, sweep.stderr
    assert [trial["params"] for trial in json.loads(sweep.stdout)] == [
        {"lr": "0.1"},
        {"lr": "0.01"},
    ]
    assert 'dtrain:   grid = ["lr=0.1,0.01"]  (../../dtrain.toml:9 [sweep])' in sweep.stderr


def test_mpi_settings_wait_for_mpi(project: Path) -> None:
    write(project, "dtrain.toml", '[run]\nmca = {btl = "tcp,self"}\n')
    done = dtrain(project, "run", "--dry-run", "true")
    assert done.returncode == 0, done.stderr
    assert 'mca = {btl = "tcp,self"}  (../../dtrain.toml:2 [run]): unused without --mpi' in (
        done.stderr
    )


def test_a_launch_without_a_file_loads_no_toml_parser(tmp_path: Path, project: Path) -> None:
    code = (
        "import sys\n"
        "from launcher.cli.main import main\n"
        "code = main(['run', '-np', '1', '--plain', 'true'])\n"
        "print(code, 'tomllib' in sys.modules, 'launcher.core.projectfile' in sys.modules)\n"
    )
    env = child_env()
    alone = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert alone.stdout.splitlines()[-1] == "0 False False", alone.stderr
    write(project, "dtrain.toml", "[run]\nnp = 1\n")
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=project
    )
    assert found.stdout.splitlines()[-1] == "0 True True", found.stderr


def test_the_python_api_reads_the_file_of_its_working_directory(
    project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(project, "dtrain.toml", '[run]\nnp = 3\nenv = ["API_FILE=yes"]\n')
    monkeypatch.chdir(project / "src" / "deep")
    assert len(launcher.launch(rank_and_variable, dry_run=True, job_dir=str(JOBS))) == 3
    assert len(launcher.launch(rank_and_variable, np=1, dry_run=True, job_dir=str(JOBS))) == 1
    ignored = launcher.launch(rank_and_variable, no_config=True, dry_run=True, job_dir=str(JOBS))
    assert len(ignored) == 1
    result = launcher.launch(rank_and_variable, job_dir=str(JOBS), quiet=True)
    assert result.values == ((0, "yes"), (1, "yes"), (2, "yes"))
    # A keyword given False is given: the file's flag does not come back under it.
    (project / "dtrain.toml").write_text("[run]\nnp = 1\nreport_bindings = true\n")
    capsys.readouterr()
    launcher.launch(rank_and_variable, job_dir=str(JOBS), quiet=True)
    assert "dtrain: rank 0 on localhost" in capsys.readouterr().err  # (--report-bindings)
    launcher.launch(rank_and_variable, job_dir=str(JOBS), quiet=True, report_bindings=False)
    assert "dtrain: rank 0 on localhost" not in capsys.readouterr().err
    (project / "dtrain.toml").write_text("[run]\nnpp = 3\n")
    with pytest.raises(launcher.UsageError, match=r"dtrain.toml:2: \[run\] npp: .*did you mean np"):
        launcher.launch(rank_and_variable, job_dir=str(JOBS))


def rank_and_variable() -> tuple[int, str | None]:
    return int(os.environ["RANK"]), os.environ.get("API_FILE")


# Pure parts: tables of whole values.


@pytest.mark.parametrize(
    ("text", "path", "line"),
    [
        ("[run]\nnp = 2\n", ("run", "np"), 2),
        ("[run]\nnp = 2\n", ("run",), 1),
        ("# c\n[ run ]  # c\n\n  np=2\n", ("run", "np"), 4),
        ("[defaults]\nnp = 1\n[run]\nnp = 2\n", ("run", "np"), 4),
        ("run.np = 2\n", ("run", "np"), 1),
        ('"run".np = 2\n', ("run", "np"), 1),
        ("[tool.dtrain.run]\nmax-restarts = 1\n", ("tool", "dtrain", "run", "max-restarts"), 2),
        ("[tool.dtrain]\nrun.np = 1\n", ("tool", "dtrain", "run", "np"), 2),
        ("[run]\nx = {np = 2}\n", ("run", "np"), None),  # (an inline table: not scanned)
        ("[[run]]\nnp = 2\n", ("run", "np"), None),
        ("[ps]\nnp = 2\n", ("run", "np"), None),
    ],
)
def test_key_line(text: str, path: tuple[str, ...], line: int | None) -> None:
    assert key_line(text, path) == line


RUN_KEYS = {
    "np": Key("np", "np", "int"),
    "hosts": Key("hosts", "host_lists", "text", multiple=True),
    "hostfile": Key("hostfile", "hostfile", "text", path="file"),
    "env": Key("env", "exports", "env", multiple=True),
    "python": Key("python", "python", "text", path="program"),
}
PS_KEYS = {"workers": Key("workers", "workers", "int"), "env": RUN_KEYS["env"]}


def source(text: str) -> Source:
    import tomllib

    return Source("dtrain.toml", "/project", text, tomllib.loads(text))


def test_settings_for_a_command() -> None:
    checked = check_file(
        source(
            '[defaults]\nenv = ["A"]\nhosts = "a,b"\nnp = 4\n'
            '[run]\nenv = ["B"]\nhostfile = "h"\npython = "venv/bin/python"\n'
            "[ps]\nworkers = 2\n"
        ),
        {"run": RUN_KEYS, "ps": PS_KEYS},
    )
    run = settings_for("run", RUN_KEYS, checked)
    assert [(s.key.name, s.value, s.section, s.where) for s in run] == [
        ("env", ["A"], "defaults", "dtrain.toml:2"),
        ("env", ["B"], "run", "dtrain.toml:6"),  # (both: env adds up)
        ("np", 4, "defaults", "dtrain.toml:4"),
        ("hostfile", "/project/h", "run", "dtrain.toml:7"),  # ([defaults]' hosts: replaced)
        ("python", "/project/venv/bin/python", "run", "dtrain.toml:8"),
    ]
    ps = settings_for("ps", PS_KEYS, checked)
    assert [(s.key.name, s.section) for s in ps] == [("env", "defaults"), ("workers", "ps")]


def setting(name: str, value: Any) -> Setting:
    return Setting(RUN_KEYS[name], value, value, "run", "dtrain.toml:1", "[run]")


def test_settle_lays_the_file_under_the_command_line() -> None:
    settings = [
        setting("np", 4),
        setting("hostfile", "/p/hosts"),
        setting("env", ["A"]),
        setting("python", "/venv/bin/python"),
    ]
    values = {
        "np": 4,
        "hostfile": "/p/hosts",
        "exports": ("A",),
        "python": "/venv/bin/python",
    }
    options = {"np": 5, "host_lists": ("x:1",), "hostfile": None, "exports": ("B=1",)}
    given = {"np", "host_lists", "exports"}
    merged, applied = settle(
        values, settings, options, given, {"np": "-np", "host_lists": "-H"}, False
    )
    assert merged == {
        "np": 5,
        "host_lists": ("x:1",),
        "hostfile": None,
        "exports": ("A", "B=1"),
        "python": "/venv/bin/python",
    }
    assert applied == [
        Applied(settings[0], "replaced", "-np"),
        Applied(settings[1], "replaced", "-H"),
        Applied(settings[2], "added", "exports"),
        Applied(settings[3], "set"),
    ]


# Whose project file dtrain obeys (issue 33, item 1): a real second user plants it.

PLANTED = '[run]\nnp = 2\nenv = ["PLANTED=yes"]\n'
SHOW = ["sh", "-c", "echo PLANTED=${PLANTED:-no}"]


def dtrain_in(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``dtrain ARGS`` in ``folder``, with a user config of its own (none unless written)."""
    environ = {**child_env(), "XDG_CONFIG_HOME": str(folder / ".no-config"), **(env or {})}
    return subprocess.run(
        [*DTRAIN, *args], capture_output=True, text=True, timeout=60, env=environ, cwd=folder
    )


def decided_in(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``dtrain_in``'s call through the CLI's ``main`` in this process: for what dtrain says or
    decides (a dry run, a refusal), not for a job that starts ranks."""
    environ = {**child_env(), "XDG_CONFIG_HOME": str(folder / ".no-config"), **(env or {})}
    return dtrain_in_process(*args, env=environ, cwd=folder)


def values(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The ranks' lines, without their tags (sorted)."""
    return sorted(line.split()[-1] for line in done.stdout.splitlines())


def planned(done: subprocess.CompletedProcess[str]) -> list[str]:
    """What SHOW would print in each rank of a ``--dry-run --json`` plan (sorted): ``values``
    of the job that plan starts."""
    assert done.returncode == 0, done.stderr
    ranks: list[dict[str, Any]] = json.loads(done.stdout)
    return sorted(f"PLANTED={rank['env'].get('PLANTED', 'no')}" for rank in ranks)


def planted_below(shared: Path) -> Path:
    """A folder of ours (root's) in the shared folder: where the user works."""
    work = shared / "work"
    work.mkdir(mode=0o755)
    return work


def ignored_line(path: Path, why: str, hint: str) -> str:
    return f"dtrain: ignoring {path}: {why} (hint: {hint})"


def test_a_file_another_user_planted_above_is_ignored_with_one_line(
    shared_tmp: Path, other_user: OtherUser
) -> None:
    planted = other_user.write(shared_tmp / "dtrain.toml", PLANTED)
    work = planted_below(shared_tmp)
    said = ignored_line(
        planted, f"owned by {other_user.name}", f"run with --config {planted} to use it"
    )
    done = dtrain_in(work, "run", "-np", "1", *SHOW)
    assert done.returncode == 0, done.stderr
    assert values(done) == ["PLANTED=no"]
    assert done.stderr.splitlines()[0] == said
    assert "settings from" not in done.stderr
    dry = decided_in(work, "run", "--dry-run", "--json", "true")
    assert dry.returncode == 0, dry.stderr
    ranks = json.loads(dry.stdout)
    assert len(ranks) == 1 and "PLANTED" not in ranks[0]["env"]  # (the file's np = 2: not)
    assert dry.stderr.splitlines() == [said]


def test_config_reads_the_file_it_names_unless_others_may_write_it(
    shared_tmp: Path, other_user: OtherUser
) -> None:
    """A file the user names is the user's choice: read whoever owns it (here the other
    user's, 0644), but refused when others may write it (one line, exit 2)."""
    planted = other_user.write(shared_tmp / "dtrain.toml", PLANTED)
    work = planted_below(shared_tmp)
    done = dtrain_in(work, "run", "--config", str(planted), "--plain", *SHOW)
    assert done.returncode == 0, done.stderr
    assert values(done) == ["PLANTED=yes", "PLANTED=yes"]
    assert done.stderr.splitlines()[0] == f"dtrain: settings from {planted} (np, env)"
    other_user.sh(f"chmod 666 '{planted}'")
    refused = decided_in(work, "run", "--config", str(planted), *SHOW)
    assert the_error(refused) == (
        f"dtrain: error: --config {planted}: writable by group or others (mode 0666): another "
        f"user could change what it runs (hint: chmod go-w {planted}; or copy "
        "it to a file of your own)"
    )
    # Found, not named: skipped, not refused.
    found = decided_in(work, "run", "--dry-run", "--json", "-np", "1", *SHOW)
    assert found.returncode == 0 and planned(found) == ["PLANTED=no"]
    assert found.stderr.splitlines()[0] == ignored_line(
        planted,
        f"owned by {other_user.name}, writable by group or others (mode 0666)",
        f"chmod go-w {planted}",
    )
    both = decided_in(work, "run", "--config", str(planted), "--no-config", "true")
    assert "give one of them" in the_error(both)


def test_a_planted_pyproject_tool_dtrain_is_ignored_too(
    shared_tmp: Path, other_user: OtherUser
) -> None:
    planted = other_user.write(
        shared_tmp / "pyproject.toml", '[tool.dtrain.run]\nenv = ["PLANTED=yes"]'
    )
    work = planted_below(shared_tmp)
    done = dtrain_in(work, "run", "-np", "1", *SHOW)
    assert done.returncode == 0, done.stderr
    assert values(done) == ["PLANTED=no"]
    assert done.stderr.splitlines()[0] == (
        f"dtrain: ignoring {planted}'s tool.dtrain: owned by {other_user.name} "
        f"(hint: run with --config {planted} to use it)"
    )
    named = decided_in(
        work, "run", "--dry-run", "--json", "-np", "1", "--config", str(planted), *SHOW
    )
    assert named.returncode == 0, named.stderr
    assert planned(named) == ["PLANTED=yes"]
    # A pyproject.toml of theirs without [tool.dtrain]: nothing of dtrain's, nothing said.
    other_user.write(planted, '[project]\nname = "theirs"')
    quiet = decided_in(work, "run", "--dry-run", "-np", "1", "true")
    assert quiet.returncode == 0 and "dtrain: ignoring" not in quiet.stderr


def test_a_group_writable_team_folder_is_trusted_once_listed(
    shared_tmp: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    team = shared_tmp / "team"
    team.mkdir()
    os.chown(team, os.geteuid(), other_user.gid)
    team.chmod(0o2775)  # the team (the other user's group) may write: they could swap proj
    proj = team / "proj"
    proj.mkdir(mode=0o755)
    write(proj, "dtrain.toml", '[run]\nenv = ["PLANTED=team"]\n')
    done = decided_in(proj, "run", "--dry-run", "--json", "-np", "1", *SHOW)
    assert done.returncode == 0, done.stderr
    assert planned(done) == ["PLANTED=no"]
    assert done.stderr.splitlines()[0] == ignored_line(
        proj / "dtrain.toml",
        f"{team} is writable by group or others (mode 2775)",
        f"chmod go-w {team}, or list {team} in ~/.config/dtrain/config.toml's trusted; or run "
        f"with --config {proj / 'dtrain.toml'} to use it",
    )
    # Listed in the user's own config (~/.config, or $XDG_CONFIG_HOME): trusted.
    home = tmp_path / "home"
    (home / ".config" / "dtrain").mkdir(parents=True)
    (home / ".config" / "dtrain" / "config.toml").write_text(f'trusted = ["{team}"]\n')
    listed = {"HOME": str(home), "XDG_CONFIG_HOME": ""}
    done = dtrain_in(proj, "run", "-np", "1", *SHOW, env=listed)
    assert done.returncode == 0, done.stderr
    assert values(done) == ["PLANTED=team"]
    assert done.stderr.splitlines()[0] == "dtrain: settings from dtrain.toml (env)"
    # A config others may write widens nothing: one line, exit 2.
    (home / ".config" / "dtrain" / "config.toml").chmod(0o666)
    assert "dtrain trusts no list there" in the_error(decided_in(proj, "run", "true", env=listed))
    # Everyone's folder (o+w, not sticky): no list trusts it.
    (home / ".config" / "dtrain" / "config.toml").chmod(0o644)
    team.chmod(0o777)
    done = decided_in(proj, "run", "--dry-run", "--json", "-np", "1", *SHOW, env=listed)
    assert planned(done) == ["PLANTED=no"] and "ignoring" in done.stderr


def test_the_search_stops_at_a_folder_of_another_user(
    shared_tmp: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    write(shared_tmp, "dtrain.toml", '[run]\nenv = ["PLANTED=above"]\n')  # ours, trusted
    theirs = shared_tmp / "theirs"
    other_user.sh(f"mkdir -m 755 '{theirs}'")
    inside = theirs / "sub"
    inside.mkdir()  # ours, in their folder
    done = decided_in(inside, "run", "--dry-run", "--json", "-np", "1", *SHOW)
    assert done.returncode == 0, done.stderr
    assert planned(done) == ["PLANTED=no"] and "dtrain: ignoring" not in done.stderr
    # Their own file there is said, as any file of another user's the search finds.
    planted = other_user.write(theirs / "dtrain.toml", PLANTED)
    done = decided_in(inside, "run", "--dry-run", "--json", "-np", "1", *SHOW)
    assert planned(done) == ["PLANTED=no"]
    assert done.stderr.splitlines()[:1] == [
        ignored_line(
            planted, f"owned by {other_user.name}", f"run with --config {planted} to use it"
        )
    ]
    # Their folder listed as trusted: the search goes on through it.
    other_user.run(["rm", "-f", str(planted)])
    config = tmp_path / "config"
    (config / "dtrain").mkdir(parents=True)
    (config / "dtrain" / "config.toml").write_text(f'trusted = ["{theirs}"]\n')
    done = dtrain_in(inside, "run", "-np", "1", *SHOW, env={"XDG_CONFIG_HOME": str(config)})
    assert values(done) == ["PLANTED=above"], done.stderr


def test_the_python_api_obeys_the_same_rule(
    shared_tmp: Path,
    other_user: OtherUser,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    planted = other_user.write(shared_tmp / "dtrain.toml", PLANTED)
    monkeypatch.chdir(planted_below(shared_tmp))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(shared_tmp / "work" / ".no-config"))
    capsys.readouterr()
    result = launcher.launch(planted_variable, job_dir=str(JOBS), quiet=True)
    assert result.values == (None,)
    assert capsys.readouterr().err.splitlines()[0] == ignored_line(
        planted, f"owned by {other_user.name}", f"run with config={str(planted)!r} to use it"
    )
    named = launcher.launch(planted_variable, job_dir=str(JOBS), quiet=True, config=str(planted))
    assert named.values == ("yes", "yes")
    assert f"dtrain: settings from {planted} (np, env)" in capsys.readouterr().err
    other_user.sh(f"chmod 666 '{planted}'")
    with pytest.raises(launcher.UsageError, match="writable by group or others"):
        launcher.launch(planted_variable, job_dir=str(JOBS), config=str(planted))


def planted_variable() -> str | None:
    return os.environ.get("PLANTED")


@pytest.mark.parametrize(
    ("named", "said"),
    [
        ("/dev/zero", "--config /dev/zero: a character device, not a file"),
        ("/tmp", "--config /tmp: a folder, not a file"),
        ("missing.toml", "--config missing.toml: no such file"),
    ],
)
def test_config_names_a_regular_file(project: Path, named: str, said: str) -> None:
    assert the_error(dtrain(project, "run", "--config", named, "true")).startswith(
        f"dtrain: error: {said}"
    )


def test_config_dev_null_is_an_empty_project_file(project: Path) -> None:
    write(project, "dtrain.toml", "[run]\nnp = 3\n")
    assert len(plan(project, "--config", "/dev/null")) == 1  # (as ssh -F /dev/null: none)
