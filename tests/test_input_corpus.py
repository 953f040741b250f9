"""A generated corpus of bad inputs through the real CLI (issue 25, section 1): each gives
exit 2 and one line ``dtrain: error: ...``, or a correct result; none a traceback or a hang.

The cases are generated, not written one by one: every duration option of every command
(found by walking the click commands) times values that are not a finite number of
seconds; every count option times values no count is; host-list tokens made of pieces that
break Slurm's syntax or multiply, and a seeded fuzz of such pieces; hostfile lines, env
files, ``-x`` values, Slurm's variables, names passed on to the ranks.  Each runs in-process
through ``launcher.cli.main.main`` (what the console script runs) in an empty directory with
an empty job directory and no Slurm variables but its own; job commands run with
``--dry-run``, so nothing is started.  A case that hangs fails at its timeout.

Files the user names (issue 33, item 6): every option that names a file dtrain reads, also
found by the walk, times ``/dev/zero``, ``/dev/urandom``, a FIFO, a folder, a binary file
and a 2 GB sparse file; a discovery script's endless or binary output, a damaged sweep
record, ``--ssh-config /dev/null`` (an empty config), and a file a real second user cannot
read.  The timeout is pytest-timeout's SIGALRM in the main thread: it interrupts a blocked
open or read, so a hang fails its case and the suite goes on.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import random
import re
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import click
import pytest
from click.testing import CliRunner

from launcher.base.errors import UsageError
from launcher.cli.main import cli, main
from launcher.cli.options import CheckedSeconds, CheckedShare
from launcher.core.peerflags import PEER_FLAGS
from tests.conftest import REPO
from tests.otheruser import OtherUser

CASE_TIMEOUT_S = 20  # a hang fails here; a case takes milliseconds
Expect = Literal["bad", "good", "any"]  # refused / a correct result / either


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    expect: Expect = "bad"
    with_job: bool = False  # runs where a job has run (dtrain logs, jobs)
    env: tuple[tuple[str, str], ...] = ()
    files: tuple[tuple[str, bytes], ...] = ()  # written into the working directory first
    check: Callable[[str], None] | None = None  # the output of a success is correct
    specials: bool = False  # the special files (SPECIAL_FILES) are made in its directory first


# How each command runs a case: the arguments before the option, and after it.
RUN = ("run", "--dry-run", "--json")
PS = ("ps", "--dry-run", "--json")
SWEEP = ("sweep", "--dry-run", "--json", "--grid", "a=1,2")
AROUND: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "run": (RUN, ("true",)),
    "ps": (PS, ("true",)),
    "sweep": (SWEEP, ("true", "{a}")),
    "logs": (("logs",), ()),
    "jobs": (("jobs",), ()),
    "check": (("check", "-H", "localhost"), ()),  # (only values click refuses: no ssh)
    "export slurm": (("export", "slurm"), ("true",)),
    "export k8s": (("export", "k8s", "--image", "img"), ("true",)),
}
PARSE_ONLY = {"check"}  # commands that would connect if a value were accepted
WITH_JOB = {"logs", "jobs"}  # commands that read a job: they run where one has run


def commands(group: click.Group = cli, path: str = "") -> Iterator[tuple[str, click.Command]]:
    """Every command of dtrain, as ``export slurm``, with its click object."""
    for name, command in group.commands.items():
        full = f"{path} {name}".strip()
        if isinstance(command, click.Group):
            yield from commands(command, full)
        elif not command.hidden:
            yield full, command


def options_of(command: click.Command, kinds: tuple[type, ...]) -> list[click.Option]:
    return [
        p
        for p in command.params
        if isinstance(p, click.Option) and not p.is_flag and isinstance(p.type, kinds)
    ]


def with_option(command: str, option: str, value: str, expect: Expect) -> Case:
    before, after = AROUND[command]
    shown = value if len(value) <= 20 else value[:12] + f"...({len(value)})"
    args = (*before, option, value, *after)
    check = CHECKS.get(command)
    name = f"{command} {option} {shown!r}"
    return Case(name, args, expect, with_job=command in WITH_JOB, check=check)


# Not a finite number of seconds, or more than a year (a larger wait overflows).
NOT_SECONDS = ("nan", "NaN", "inf", "-inf", "1e400", "1e12")


def duration_cases() -> list[Case]:
    return [
        with_option(name, option.opts[0], value, "bad")
        for name, command in commands()
        for option in options_of(command, (click.types.FloatParamType,))
        for value in NOT_SECONDS
    ]


NO_COUNT = ("\u00b2", "1e3", "0x10", "9" * 5000, "")  # '²'.isdigit() is True; 5,000 digits
HUGE = ("99999999999999999999", "100000000")
# Counts dtrain bounds (a huge one would plan, allocate or overflow): refused when huge.
BOUNDED = {"-np", "-N", "--nnodes", "--min-np", "--max-np", "--gpus-per-rank", "--max-restarts",
           "--master-port", "--ssh-port", "--workers", "--ps", "--restart-workers", "--random",
           "--np-per-trial", "--nproc-per-node"}  # fmt: skip
# Other launchers' spellings of them (mpirun's -n is -np).
PEER_SPELLINGS = {flag: row.dtrain for row in PEER_FLAGS if row.field for flag in row.flags.split()}
TEXT_COUNTS = {"run": ("--nproc-per-node", "--nnodes"), "export slurm": ("--ntasks-per-node",)}


def count_cases() -> list[Case]:
    cases = []
    for name, command in commands():
        counts = [o.opts[0] for o in options_of(command, (click.types.IntParamType,))]
        for option in [*counts, *TEXT_COUNTS.get(name, ())]:
            cases += [with_option(name, option, value, "bad") for value in NO_COUNT]
            peer = PEER_SPELLINGS.get(option) if name == "run" else None  # (run takes them)
            bounded = option in BOUNDED or peer in BOUNDED
            if name not in PARSE_ONLY or bounded:
                expect: Expect = "bad" if bounded else "any"
                cases += [with_option(name, option, v, expect) for v in (*HUGE, "-1")]
    return cases


def is_host_name(name: str) -> bool:
    if ":" in name:
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return False
        return True
    return bool(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}", name))


def hosts_correct(out: str) -> None:
    """``dtrain hosts --json``: host names as ssh takes them, each with slots (None: counted
    on the host when a job starts, for a bare hostfile line)."""
    hosts = json.loads(out)
    assert 1 <= len(hosts) <= 100_000
    for host in hosts:
        assert is_host_name(host["host"]), host
        assert host["slots"] is None or host["slots"] >= 1, host


def plan_correct(out: str) -> None:
    """A dry run's plan: ranks 0..N-1, each on a host."""
    plan = json.loads(out)
    assert [entry["rank"] for entry in plan] == list(range(len(plan)))
    assert all(is_host_name(entry["host"]) for entry in plan)


def trials_correct(out: str) -> None:
    """A sweep's dry run: its trials, numbered from 0."""
    assert [trial["trial"] for trial in json.loads(out)] == [0, 1]


CHECKS = {"run": plan_correct, "ps": plan_correct, "sweep": trials_correct}


HOST_SHAPES = ("{}", "h{}", "u@h{}", "h{}:2", "h1,h{}")
BAD_PIECES = ("[1-1000][1-1000][1-1000]", "[0-9]" * 6, "[1-99999999999]", "[]", "[2-1]", "[1",
              "1]", "[a-b]", "[1-2[3]]", "[\u0663]", "a x", "\0", "\u00e9", ";id", "$(id)", "/x",
              "..", ":", ":0", ":-1", ":x", ":99999999999", ":\u00b2", "@", "[1-2]]")  # fmt: skip
LONG_NAME = "h" * 300  # over 255 bytes: a file name too long for the "is it a file?" check


def host_list_cases() -> list[Case]:
    cases = [
        Case(f"-H {shape.format(piece)!r}", ("hosts", "--json", "-H", shape.format(piece)))
        for shape, piece in itertools.product(HOST_SHAPES, BAD_PIECES)
    ]
    cases.append(Case("-H a[1-60000],b[1-60000]", ("hosts", "-H", "a[1-60000],b[1-60000]")))
    cases.append(Case("-H a[1-60000] -H b[1-60000]",
                      ("hosts", "-H", "a[1-60000]", "-H", "b[1-60000]")))  # fmt: skip
    cases.append(Case("-H over 255 bytes", ("hosts", "-H", LONG_NAME)))
    cases.append(
        Case("-H h[1-3]:2", ("hosts", "--json", "-H", "h[1-3]:2"), "good", check=hosts_correct)
    )
    return cases


RANGES = {"1-3": ("1", "2", "3"), "01-03": ("01", "02", "03"), "1,3": ("1", "3"), "5": ("5",),
          "8-11": ("8", "9", "10", "11")}  # fmt: skip
STEMS = ("h", "node", "gpu-", "u@n", "10.0.0.")
FUZZ_CHARS = "[]-,:@. _*0129hx\0\u00e9;/"


def generated_host_list(rng: random.Random) -> tuple[str, list[dict[str, Any]] | None]:
    """A host list made by the grammar, and the hosts it means (None: it is refused)."""
    items, entries, refused = [], [], False
    for _ in range(rng.randint(1, 3)):
        stem = rng.choice(STEMS)
        text, names = stem, [stem]
        for _ in range(1 if stem == "10.0.0." else rng.randint(0, 2)):
            key = rng.choice(list(RANGES) if stem != "10.0.0." else ["1-3", "5"])
            text, names = text + f"[{key}]", [n + v for n in names for v in RANGES[key]]
        slots = rng.choice([None, None, "1", "2", "8", "0", "x"])
        text += f":{slots}" if slots else ""
        refused |= slots in ("0", "x")
        items.append(text)
        for name in names:
            user, _, host = name.rpartition("@")
            count = 0 if refused else int(slots or 1)
            entries.append({"host": host, "user": user or None, "slots": count})
    return ",".join(items), None if refused else merged(entries)


def merged(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A host listed again adds its slots (as Open MPI's -H a:2,a is 3)."""
    hosts: dict[tuple[str | None, str], dict[str, Any]] = {}
    for entry in entries:
        key = (entry["user"], entry["host"])
        if key in hosts:
            hosts[key]["slots"] += entry["slots"]
        else:
            hosts[key] = dict(entry)
    return list(hosts.values())


def mutated(text: str, rng: random.Random) -> str:
    """One or two characters inserted, removed or replaced."""
    for _ in range(rng.randint(1, 2)):
        at, char = rng.randrange(len(text) + 1), rng.choice(FUZZ_CHARS)
        text = rng.choice([text[:at] + char + text[at:], text[:at] + text[at + 1 :],
                           text[:at] + char + text[at + 1 :]])  # fmt: skip
    return text


def hosts_equal(expected: list[dict[str, Any]]) -> Callable[[str], None]:
    def check(out: str) -> None:
        hosts_correct(out)
        found = [{k: h[k] for k in ("host", "user", "slots")} for h in json.loads(out)]
        assert found == expected

    return check


def fuzzed_host_list_cases(count: int = 80, seed: int = 25) -> list[Case]:
    """Host lists made by the grammar (their hosts known), half of them then mutated (either
    refused in one line, or hosts ssh can take)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        text, expected = generated_host_list(rng)
        args = ("hosts", "--json", "-H")
        if rng.random() < 0.5:
            token = mutated(text, rng)
            cases.append(Case(f"fuzz {i} -H {token!r}", (*args, token), "any", check=hosts_correct))
        elif expected is None:
            cases.append(Case(f"fuzz {i} -H {text!r}", (*args, text), "bad"))
        else:
            check = hosts_equal(expected)
            cases.append(Case(f"fuzz {i} -H {text!r}", (*args, text), "good", check=check))
    return cases


BAD_HOSTFILE_LINES = ("h slots=0", "h slots=-1", "h slots=99999999999", "h slots=\u00b2",
                      "h slots=nan", "h max_slots=1 slots=2", "h gpus=", "h gpus=0,0",
                      "h gpus=0;1", "h foo=1", "h:2 slots=2", "h slots", "h\0",
                      "h[1-1000][1-1000]", "h" + "[0-9]" * 6, "[::1", "[zz]:2", "u@@h", "@h",
                      LONG_NAME, "-h", "h\x1b[31m")  # fmt: skip


def hostfile_cases() -> list[Case]:
    contexts = {"hosts": ("hosts", "--hostfile", "hf"),
                "run": (*RUN, "--hostfile", "hf", "-np", "1", "true")}  # fmt: skip
    cases = [
        Case(f"{how} hostfile {line!r}"[:80], args, files=(("hf", line.encode() + b"\n"),))
        for line in BAD_HOSTFILE_LINES
        for how, args in contexts.items()
    ]
    for content in (b"\xff\xfe", b"", b"# a comment only\n"):
        cases.append(Case(f"hostfile {content!r}", contexts["hosts"], files=(("hf", content),)))
    crlf = (("hf", b"h1 slots=2\r\nh2\r\n"),)
    cases.append(Case("hostfile CRLF", (*contexts["hosts"], "--json"), "good", files=crlf,
                      check=hosts_correct))  # fmt: skip
    return cases


BAD_ENV_FILES = (b"A=\0", b"A=x\0y", b'A="x\0"', b"A", b"1A=1", b"A-B=1", b"A='open", b'A="x" y',
                 b"export", b"A=" + b"x" * 200_000, b"\xff=1", b"A=\xff", b"=1",
                 b"A\0=1")  # fmt: skip
BAD_EXPORTS = ("A=\0", "A=x\0y", "=1", "A-B=1", "UNSET_VARIABLE_H25", "A=" + "x" * 200_000,
               "1A", "A\0B=1", "A B=1", "A=\ud800")  # fmt: skip


def env_cases() -> list[Case]:
    cases = []
    for command in ("run", "ps", "sweep"):
        before, after = AROUND[command]
        for content in BAD_ENV_FILES:
            name = f"{command} --env-file {content[:20]!r}"
            args = (*before, "--env-file", "e.env", *after)
            cases.append(Case(name, args, files=(("e.env", content + b"\n"),)))
        cases += [with_option(command, "-x", value, "bad") for value in BAD_EXPORTS]
    return cases


def slurm_env(
    nodes: str = "n[1-2]", tasks: str = "1(x2)", **more: str
) -> tuple[tuple[str, str], ...]:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": nodes, "SLURM_TASKS_PER_NODE": tasks}
    return tuple({**env, **more}.items())


SLURM_VARIABLES = (
    slurm_env("n[1-10]", "0(x10)"), slurm_env(tasks="0,1"), slurm_env(tasks="x"),
    slurm_env(tasks="2(x0)"), slurm_env(tasks="1(x999999999)"), slurm_env(tasks="9" * 30),
    slurm_env(tasks="-1"), slurm_env("n[1-3]", "1(x2)"), slurm_env(tasks="100001(x2)"),
    slurm_env(tasks="\u00b2(x2)"), slurm_env("n[1-"), slurm_env("a b"), slurm_env("a;b"),
    slurm_env("n[1-1000][1-1000]"), slurm_env("-h"), slurm_env(","), slurm_env("n[]"),
    slurm_env("\u00e9"), slurm_env(SLURM_JOB_ID="abc"), slurm_env(SLURM_JOB_ID="-h"),
    slurm_env(tasks="", SLURM_JOB_CPUS_PER_NODE="0(x2)"),
)  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (slurm_env("n[1-10]", "0(x10)"), "SLURM_TASKS_PER_NODE '0(x10)': 0 tasks on node n1"),
        (slurm_env(tasks="2(x0)"), "SLURM_TASKS_PER_NODE '2(x0)': bad item '2(x0)': repeated 0"),
        (slurm_env(tasks="", SLURM_JOB_CPUS_PER_NODE="0(x2)"), "SLURM_JOB_CPUS_PER_NODE '0(x2)'"),
        (slurm_env("a b"), "SLURM_JOB_NODELIST 'a b': invalid host name 'a b'"),
        (slurm_env("n[1-1000][1-1000]"), "SLURM_JOB_NODELIST: 'n[1-1000][1-1000]' gives more"),
        (slurm_env(SLURM_JOB_ID="-h"), "SLURM_JOB_ID '-h': not a Slurm job id"),
    ],
)
def test_slurm_variables_are_named(env: tuple[tuple[str, str], ...], message: str) -> None:
    """A value Slurm never sets gave hosts of 0 slots, then '-np 0: must be at least 1'."""
    from launcher.transport.slurm import allocation_from

    with pytest.raises(UsageError) as caught:
        allocation_from(dict(env))
    assert caught.value.message.startswith(message), caught.value.message


def slurm_cases() -> list[Case]:
    return [
        Case(f"{args[0]} in Slurm {dict(env)}"[:100], args, env=env)
        for env in SLURM_VARIABLES
        for args in (("hosts",), (*RUN, "-np", "1", "true"))
    ]


BAD_NAMES = {
    "--network-interface": ("eth0;id", "", "a" * 16, "eth0 ", "$(id)", "eth0,,eth1", "eth0/1",
                            ".", "eth0:1"),
    "--master-addr": ("a b", "", "-h", "1.2.3.999", "[::1", "a;b", "x" * 300, "h\0", "fe80::zz"),
    "--rdzv-endpoint": ("h:99999", "h:\u00b2", ":1", "h:", "h:0", "a b:1"),
    "--mca": ("btl",),  # (its second value is the command: the option needs two)
    "--map-by": ("ppr:0:node", "ppr:x:node", "foo", "slot:BAD", "ppr:100001:node",
                 "ppr:\u00b2:node"),
    "--nproc-per-node": ("auto2", "0"),
    "--nnodes": ("0", "2:3", "a"),
    "--include": ("@", "h:", "h:x"),
    "--ranks": ("x", "1-2"),
    "--local-ranks": ("x",),
    "--tag-format": ("{nope}", "{rank", "{rank:q}", "{0}"),
    "--redirects": ("9",),
    "--launcher": ("foo",),
}  # fmt: skip
PATHS: tuple[tuple[str, str, Expect], ...] = (  # files and folders not what the option needs
    ("--hostfile", ".", "bad"), ("--hostfile", "/dev/null", "bad"),
    ("--hostfile", "/nonexistent", "bad"), ("--env-file", ".", "bad"),
    ("--env-file", "/nonexistent", "bad"), ("--workdir", "/nonexistent", "bad"),
    ("--workdir", "/etc/hostname", "bad"), ("--output-dir", "/etc/hostname", "any"),
    ("--python", "/nonexistent", "any"), ("--ssh-config", ".", "any"),
    ("--job-dir", "/etc/hostname", "any"), ("--host-discovery-script", "/nonexistent", "bad"),
)  # fmt: skip
MPI_ONLY = (("--mca", "btl", "tcp,self"), ("--mpirun", "/x"), ("--mpirun-args", "-v"),
            ("--mpi-args", "-v"), ("--launcher_args", "-v"))  # fmt: skip
MISTAKES = (  # the other mistakes of issue 25's first section, as typed
    ("-np", "2", "python", "x.py"),
    ("run", "-np", "2", "--grace"),
    ("logs", "--since", "yesterday"),
    ("logs", "--since", "1e400s"),
    ("logs", "--grep", "("),
    ("stop", "no-such-job"),
    ("stacks", "no-such-job"),
)


def name_cases() -> list[Case]:
    cases = [
        with_option("run", flag, value, "bad")
        for flag, values in BAD_NAMES.items()
        for value in values
    ]
    cases += [
        with_option("ps", "--network-interface", v, "bad") for v in BAD_NAMES["--network-interface"]
    ]
    cases += [
        Case(f"run {' '.join(args)} without --mpi", (*RUN, *args, "true")) for args in MPI_ONLY
    ]
    cases += [Case(" ".join(args), args) for args in MISTAKES]
    cases += [with_option("run", flag, path, expect) for flag, path, expect in PATHS]
    cases += [
        Case("run -H h7:2 h8:2", (*RUN, "-H", "h7:2", "h8:2"), "any", check=plan_correct),
        Case("run ok controls", (*RUN, "--grace", "0", "--timeout", "1e6", "--network-interface",
             "ib0,ib1", "--master-addr", "[fe80::1]", "-np", "2", "true"), "good",
             check=plan_correct),
    ]  # fmt: skip
    return cases


BAD_PROJECT_FILES = (  # dtrain.toml in the working directory (issue 26, section 2)
    b"[run]\nnmp = 2\n", b"[run]\nnp = 'two'\n", b"[run]\nnp = true\n", b"[rn]\nnp = 2\n",
    b"np = 2\n", b"[run]\nnp =\n", b"[run\nnp = 2\n", b"[run]\nhosts = 4\n",
    b"[run]\ngrace = nan\n", b"[run]\ngrace = inf\n", b"[run]\ntimeout = 1e400\n",
    b"[run]\nmax_restarts = -1\n", b"[run]\nbind_to = 'cores'\n", b"[run]\ndry_run = true\n",
    b"[run]\nenv = ['WANDB_API_KEY=abc']\n", b"[run]\nenv = {HF_TOKEN = 'x'}\n",
    b"[run]\nenv = ['A-B']\n", b"[run]\nenv = ['W*=1']\n", b"[run]\nenv = 5\n",
    b'[run]\nenv = ["A=\\u0000"]\n', b"[ps]\nnp = 2\n", b"[sweep]\nseed = 'x'\n",
    b"[run]\nnp = 2\nnp = 3\n", b"[run]\nmax_restarts = 1\nmax-restarts = 2\n",
    b"run = 3\n", b"[run]\nnp = 2\xff\n", b"[defaults]\nworkers = 'x'\n",
    b"[run]\nmca = 'x'\n", b"[run]\ncolor = 'yes'\n",
)  # fmt: skip


def project_file_cases() -> list[Case]:
    cases = []
    for command in ("run", "ps", "sweep"):
        before, after = AROUND[command]
        for content in BAD_PROJECT_FILES:
            name = f"{command} dtrain.toml {content[:30]!r}"
            cases.append(Case(name, (*before, *after), files=(("dtrain.toml", content),)))
    return cases


# -- files the user names (issue 33, item 6) ----------------------------------------------
# Every option that names a file dtrain reads, found by its metavar (FILE, or KEY: a private
# key) or a click.Path type, with other launchers' spellings of them, times files that are no
# such file: each one line naming the path and why, exit 2, never a hang nor GBs of memory.
# ``special_files`` makes the relative ones in the case's directory.
SPECIAL_FILES = {  # the value given: words its line must hold
    "/dev/zero": "a character device",
    "/dev/urandom": "a character device",
    "fifo": "a FIFO",
    "folder": "a folder, not a file",
    "binary": "a binary file",
    "sparse": "2048 MiB, over the",  # (2 GB, no disk used: refused by its size unread)
}
FILE_METAVARS = {"FILE", "KEY"}
NOT_READ = {  # options whose file dtrain does not read now
    ("export slurm", "-o"): "the script is written there (a pipe, /dev/stdout: fine)",
    ("export slurm", "--env-file"): "named in the script: read when the job runs, by dtrain run",
}
FILE_AROUND = {
    **AROUND,
    "hosts": (("hosts",), ()),
    "check --hostfile": (("check",), ()),  # (check's -H and --hostfile exclude each other)
}


def special_files(directory: Path) -> None:
    os.mkfifo(directory / "fifo")
    (directory / "folder").mkdir()
    (directory / "binary").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    with open(directory / "sparse", "wb") as sparse:
        sparse.truncate(2 << 30)


def file_options(name: str, command: click.Command) -> list[str]:
    """The options of ``command`` that name a file dtrain reads, each spelling of them."""
    found = []
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_flag:
            continue
        spelled = PEER_SPELLINGS.get(param.opts[0]) if name == "run" else None
        meant = spelled or param.opts[0]
        is_file = isinstance(param.type, click.Path) or (param.metavar or "") in FILE_METAVARS
        if (is_file or spelled in ("--hostfile", "--ssh-identity")) and (
            (name, meant) not in NOT_READ
        ):
            found += param.opts if spelled else param.opts[:1]  # (mpirun's three spellings)
    return found


def file_cases() -> list[Case]:
    cases = []
    for name, command in commands():
        for option in file_options(name, command):
            default = (tuple(name.split()), ())
            before, after = FILE_AROUND.get(f"{name} {option}", FILE_AROUND.get(name, default))
            for value in SPECIAL_FILES:
                args = (*before, option, value, *after)
                cases.append(Case(f"{name} {option} {value}", args, specials=True))
    return cases


FILE_CASES = file_cases()


CASES = [
    *duration_cases(),
    *count_cases(),
    *host_list_cases(),
    *fuzzed_host_list_cases(),
    *hostfile_cases(),
    *env_cases(),
    *slurm_cases(),
    *name_cases(),
    *project_file_cases(),
]


def as_param(case: Case) -> Any:
    return pytest.param(case, id=case.name.encode("ascii", "backslashreplace").decode())


def run_cli(case: Case, directory: Path, jobs: Path | None = None) -> tuple[int, str, str]:
    """``main(args)`` in ``directory``, its output captured, with no Slurm variable but the
    case's, and ``jobs`` as the job directory (default: an empty one)."""
    for name, content in case.files:
        (directory / name).write_bytes(content)
    if case.specials:
        special_files(directory)
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SLURM_")}
    env.update(DTRAIN_JOB_DIR=str(jobs or directory / "jobs"), NO_COLOR="1", **dict(case.env))
    here = os.getcwd()
    os.chdir(directory)
    try:
        with CliRunner().isolation(env=env) as (out, err, _):
            code = main(list(case.args))
            return (
                code,
                out.getvalue().decode(errors="replace"),
                err.getvalue().decode(errors="replace"),
            )
    finally:
        os.chdir(here)


def test_the_corpus_is_large_and_its_names_unique() -> None:
    assert len(CASES) >= 197
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def jobs_with_a_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job directory where one job has run (and ended): what dtrain logs and jobs read."""
    jobs = tmp_path_factory.mktemp("jobs")
    jobs.chmod(0o700)
    env = {**os.environ, "DTRAIN_JOB_DIR": str(jobs)}
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "run", "-np", "1", "true"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return jobs


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("case", [as_param(case) for case in CASES])
def test_bad_input_gives_one_line_or_a_correct_result(
    case: Case, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    jobs = request.getfixturevalue("jobs_with_a_job") if case.with_job else None
    code, out, err = run_cli(case, tmp_path, jobs)
    assert "Traceback" not in out + err
    if code == 0 and case.expect != "bad":
        if case.check is not None:
            case.check(out)
        return
    assert case.expect != "good", f"exit {code}: {out}{err}"
    lines = (out + err).splitlines()
    assert code == 2, f"exit {code}: {out}{err}"
    assert len(lines) == 1, out + err
    assert lines[0].startswith("dtrain: error: "), lines[0]


def test_every_float_option_is_a_duration_refusing_nan_and_inf() -> None:
    """No float option can miss the check: each is a ``CheckedSeconds``, which refuses nan, inf and
    more than a year, or a ``Share`` (--straggler-ratio), which refuses nan and all but
    (0, 1) (the corpus runs each of them with those values)."""
    floats = [
        (name, option.opts[0], option.type)
        for name, command in commands()
        for option in options_of(command, (click.types.FloatParamType,))
    ]
    assert floats  # (the walk finds them)
    for name, flag, kind in floats:
        assert isinstance(kind, CheckedSeconds | CheckedShare), f"dtrain {name} {flag} is {kind!r}"
        for value in NOT_SECONDS:  # (a table row's type says it as the API would: one line)
            with pytest.raises((click.BadParameter, UsageError)):
                kind.convert(value, None, None)


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("case", [as_param(case) for case in FILE_CASES])
def test_a_special_file_named_is_one_line(case: Case, tmp_path: Path) -> None:
    """Before: --hostfile /dev/zero grew to GBs and never ended, /dev/urandom and a FIFO
    hung (--env-file too), a binary file or a folder gave a codec's or errno's text."""
    code, out, err = run_cli(case, tmp_path)
    value = case.args[case.args.index(case.name.rsplit(" ", 1)[1])]
    assert (code, len((out + err).splitlines())) == (2, 1), out + err
    assert err.startswith("dtrain: error: "), err
    assert value in err and SPECIAL_FILES[value] in err, err  # (what it is, not its mode)


def test_every_command_that_takes_a_file_is_in_the_corpus() -> None:
    """The walk finds the files of run, ps, sweep, hosts, check and export k8s, and other
    launchers' spellings (mpirun's -hostfile, horovodrun's --ssh-identity-file)."""
    options = {(c.args[0], o) for c in FILE_CASES for o in c.args if o.startswith("-")}
    wanted = {
        ("run", "--hostfile"),
        ("run", "--env-file"),
        ("run", "--ssh-config"),
        ("run", "--ssh-identity"),
        ("run", "-machinefile"),
        ("hosts", "--hostfile"),
        ("run", "--ssh-identity-file"),
        ("ps", "--env-file"),
        ("check", "--hostfile"),
        ("check", "--ssh-config"),
        ("sweep", "--hostfile"),
        ("export", "--env-file"),
    }
    assert wanted <= options, wanted - options  # fmt: skip
    assert len(FILE_CASES) >= 20 * len(SPECIAL_FILES)


@pytest.mark.parametrize("command", ["run", "ps", "sweep"])
def test_ssh_config_dev_null_is_an_empty_config(command: str, tmp_path: Path) -> None:
    """OpenSSH's ``-F /dev/null`` (no config): before, '--ssh-config /dev/null: no such file',
    exit 1."""
    before, after = AROUND[command]
    args = (*before, "--ssh-config", "/dev/null", "-H", "far", *after)
    code, out, err = run_cli(Case("dev/null", args), tmp_path)
    assert code == 0, err
    CHECKS[command](out)


@pytest.mark.timeout(CASE_TIMEOUT_S)
def test_a_fifo_as_the_script_does_not_hang_a_dry_run(tmp_path: Path) -> None:
    """dtrain peeks at a ``.py`` script (does it use mpi4py?): a FIFO there hung the open."""
    os.mkfifo(tmp_path / "train.py")
    code, out, err = run_cli(Case("fifo", (*RUN, "-np", "1", "python", "train.py")), tmp_path)
    assert code == 0, err
    plan_correct(out)


DISCOVERY_SCRIPTS = {  # what the script does: words of its one line
    "exec yes localhost": "printed over 16 MiB, the most a host list may have",
    "printf 'h1\\nh\\351\\n'": "output:2: not UTF-8 text (byte 5)",
    "printf 'localhost\\0\\n'": "output: binary, not text (hint: the script must print",
    "echo oops >&2; exit 3": "exit code 3 (oops)",
}


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("body", list(DISCOVERY_SCRIPTS))
def test_a_discovery_scripts_output_is_bounded_and_text(body: str, tmp_path: Path) -> None:
    """Its output is read as a hostfile is: 16 MiB at most (a script printing without end
    grew dtrain's memory until its 30 s timeout), UTF-8 text, else one line naming it."""
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    args = (*RUN, "--host-discovery-script", str(script), "-np", "1", "true")
    code, out, err = run_cli(Case("discovery", args), tmp_path)
    assert (code, len((out + err).splitlines())) == (2, 1), out + err
    assert err.startswith(f"dtrain: error: --host-discovery-script {script}"), err
    assert DISCOVERY_SCRIPTS[body] in err, err


SWEEP_ID = "20260101-000000-abcdef"
DAMAGED_RECORDS = {  # sweep.json's content (None: a 2 GB sparse file): words of its line
    b"\x00\x01binary": "a binary file, not text",
    b"{not json": "is damaged (not JSON: line 1)",
    b"[1, 2]": "is damaged (a JSON list, not an object)",
    b"{}": "is damaged (KeyError: 'config')",
    b'{"config": 5, "settings": {}}': "is damaged (",
    None: "over the 64 MiB such a file may have",
}


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("content", list(DAMAGED_RECORDS), ids=lambda c: repr(c)[:20])
def test_a_damaged_sweep_record_is_one_line(content: bytes | None, tmp_path: Path) -> None:
    """``sweep --resume`` reads its record back as a file the user names (a job root is any
    folder): before, a record that was not what dtrain wrote was a KeyError traceback."""
    jobs = tmp_path / "jobs"
    record = jobs / "sweeps" / SWEEP_ID / "sweep.json"
    record.parent.mkdir(parents=True)
    jobs.chmod(0o700)
    with open(record, "wb") as f:
        f.write(content) if content is not None else f.truncate(2 << 30)
    case = Case("resume", ("sweep", "--resume", SWEEP_ID))
    code, out, err = run_cli(case, tmp_path, jobs)
    assert (code, len((out + err).splitlines())) == (2, 1), out + err
    assert err.startswith(f"dtrain: error: --resume {SWEEP_ID}: its record {record}"), err
    assert DAMAGED_RECORDS[content] in err, err


def other_users_python(user: OtherUser) -> list[str]:
    """How the other user runs this checkout's dtrain: this interpreter where it may run
    it, else the system's python3 of the same version with the venv's packages on its path."""
    probe = [sys.executable, "-c", "import launcher.cli.main"]
    if user.run(probe, cwd=REPO).returncode == 0:
        return [sys.executable]
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    packages = next(Path(sys.prefix).glob("lib/python*/site-packages"), None)
    if not os.access(system, os.X_OK) or packages is None:
        pytest.skip(f"the other user cannot run {sys.executable} (a folder above is private)")
    command = ["env", f"PYTHONPATH={REPO}:{packages}", system]
    if user.run([*command, *probe[1:]], cwd=REPO).returncode != 0:
        pytest.skip(f"the other user cannot import dtrain from {REPO}")
    return command


def test_an_unreadable_hostfile_is_one_line_as_another_user(
    other_user: OtherUser, shared_tmp: Path
) -> None:
    """A 0600 hostfile of root's, named by another user (root reads everything: the check
    needs a second user): one line naming it, exit 2."""
    hostfile = shared_tmp / "hosts"
    hostfile.write_text("localhost slots=2\n")
    hostfile.chmod(0o600)
    python = other_users_python(other_user)
    done = other_user.run([*python, "-m", "launcher", "hosts", "--hostfile", str(hostfile)],
                          cwd=REPO, timeout=CASE_TIMEOUT_S)  # fmt: skip
    assert (done.returncode, done.stdout) == (2, ""), done.stdout + done.stderr
    assert done.stderr == (
        f"dtrain: error: --hostfile {hostfile}: permission denied "
        "(hint: check the file's permissions)\n"
    )


# What dtrain finds by itself, planted by another user in a folder others can write: each
# skipped (the project file: the run goes on without it) or refused, in one line.
FOUND_BY_ITSELF = ("project file", "job root", "sync cache")


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("found", FOUND_BY_ITSELF)
def test_what_another_user_planted_is_skipped_or_refused_in_one_line(
    found: str, other_user: OtherUser, shared_tmp: Path
) -> None:
    planted = shared_tmp / "planted"
    other_user.sh(f"mkdir -m 755 {planted}")
    if found == "project file":
        other_user.write(planted / "dtrain.toml", '[run]\nenv = {PLANTED = "yes"}')
        jobs = shared_tmp / "jobs"  # (root's, private, in the sticky folder)
        case = Case("planted", (*RUN, "-np", "1", "true"))
        code, out, err = run_cli(case, planted, jobs)  # (run from the planted folder)
        assert code == 0, err
        assert err.splitlines()[0] == (
            f"dtrain: ignoring {planted / 'dtrain.toml'}: owned by {other_user.name} "
            f"(hint: run with --config {planted / 'dtrain.toml'} to use it)"
        ), err
        assert "PLANTED" not in out
    elif found == "job root":
        other_user.sh(f"mkdir -m 700 {planted}/jobs")
        case = Case("root", ("jobs", "--job-dir", str(planted / "jobs")))
        code, out, err = run_cli(case, shared_tmp)
        assert (code, out) == (2, ""), err
        assert len(err.splitlines()) == 1, err
        assert err == (
            f"dtrain: error: --job-dir {planted / 'jobs'}: its folder {planted} is owned by "
            f"{other_user.name} (uid {other_user.uid}): another user could swap the jobs for "
            "their own (hint: pass a --job-dir in a folder of yours)\n"
        )
    else:
        from tests.test_sync_receiver import file_row, receive

        other_user.sh(f"mkdir -m 777 {planted}/cache")
        before = sorted(str(p) for p in planted.rglob("*"))
        content = b"print(1)\n"
        request = {"key": "ab12", "entries": [file_row("train.py", content)]}
        code, answers, err = receive(planted / "cache", request, content)
        assert (code, len(err.splitlines())) == (3, 1), err
        assert "refused" in answers[-1], answers  # (the launcher's line, from the host)
        assert err.startswith("dtrain sync: ") and "owned by" in err, err
        assert sorted(str(p) for p in planted.rglob("*")) == before  # nothing made there
        assert stat.S_IMODE((planted / "cache").stat().st_mode) == 0o777  # not chmodded
