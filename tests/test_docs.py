"""The docs hold what they say: every relative link of README.md and docs/*.md resolves (files
and #anchors), the README's first lines and quick start run as written, its failure sample
is what dtrain prints, and so is the sweep table of docs/sweeps.md."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # inline links and images
JOB_ID = re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{6}\b")
SETUP = (REPO / "scripts" / "setup").read_text()
INSTALLS = (["python3", "-m", "venv"], [".", ".venv/bin/activate"], ["pip", "install"])


def prose(text: str) -> Iterator[str]:
    """The lines of a page that are not code: fenced blocks and lines indented as code are
    left out, and so are `code spans` (a link written in code is an example, not a link)."""
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("    "):
            yield re.sub(r"`[^`]*`", "", line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them (a repeated one gets -1, -2...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The targets of a page's links and images, outside code."""
    return [target for line in prose(page.read_text()) for target in LINK.findall(line)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ... are not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(REPO) or not file.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


QUOTED_PATH = re.compile(
    r"`(?:\./)?((?:launcher|tests|benchmarks|examples|scripts|hostfiles|docs)/[\w./-]*)`"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_quoted_path_exists(page: Path) -> None:
    """A path the docs quote (`tests/test_job.py`, `launcher/remote/`) names a file or folder
    of the repository: modules move, and their old names must not stay behind in the docs.
    `tests/fakes.RecordingFrontend` names a module's attribute."""
    stale = []
    for path in QUOTED_PATH.findall(page.read_text()):
        module = re.fullmatch(r"(.*)\.[A-Za-z_]\w*", path)
        if not (REPO / path).exists() and not (module and (REPO / f"{module[1]}.py").exists()):
            stale.append(path)
    assert not stale, f"{page.relative_to(REPO)} names what is not there: {stale}"


def test_the_pages_link_to_each_other() -> None:
    """Every page of docs/ is reachable from the index, and the index from the README."""
    index = REPO / "docs" / "README.md"
    listed = {(index.parent / target).resolve() for target in links(index)}
    unlisted = [p.name for p in PAGES[1:] if p != index and p.resolve() not in listed]
    assert not unlisted, f"docs/README.md does not list {unlisted}"
    assert "docs/README.md" in links(REPO / "README.md")


def block(name: str, page: Path = REPO / "README.md") -> list[str]:
    """The lines of a page's block between <!-- name --> and <!-- /name -->, unindented."""
    text = page.read_text()
    inner = text.split(f"<!-- {name} -->\n", 1)[1].split(f"<!-- /{name} -->", 1)[0]
    return [line.removeprefix("    ") for line in inner.splitlines() if line.strip()]


def first_commands() -> list[list[str]]:
    """The README's first code block (install and run), as the words of each `&&` step."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    "))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("    "))
    return steps(" ".join(lines[start:end]))


def steps(line: str) -> list[list[str]]:
    """The words of each step of a command line (`a && b`), its comment dropped."""
    found: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            found.append([])
        else:
            found[-1].append(word)
    return found


def is_install(step: list[str]) -> bool:
    """Whether a step makes the environment (checked against scripts/setup, not run)."""
    return any(step[: len(start)] == start for start in INSTALLS)


def extras() -> dict[str, str]:
    """pyproject.toml's extras: name -> its requirements, as text."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r"^(\w+) = \[(.*?)\]", section, re.M | re.S))


def check_install(step: list[str]) -> None:
    """An install step must be what scripts/setup does: the same venv, torch pinned first to
    the same version, extras that exist; the `torch` extra brings numpy (torch warns on every
    rank without it)."""
    command = shlex.join(step)
    if step[:2] == ["pip", "install"]:
        pin = re.search(r"torch==[\w.+]+", SETUP)
        assert pin and step[2] == pin.group(0), f"{command}: pin torch first, as scripts/setup"
        for word in step[3:]:
            match = re.fullmatch(r"\.(?:\[([\w,]+)\])?", word)  # . or .[extra,...]
            assert word == "-e" or match, f"{command}: {word}"
            named = match.group(1).split(",") if match and match.group(1) else []
            assert set(named) <= set(extras()), f"{command}: no extra {set(named) - set(extras())}"
        assert '"numpy' in extras()["torch"], "the torch extra must bring numpy"
    elif step[0] == "python3":
        assert command in SETUP, f"{command}: scripts/setup does not"


def quickstart_env(tmp_path: Path) -> dict[str, str]:
    """This test's environment: the repository's .venv first on PATH, its own job directory."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["DTRAIN_JOB_DIR"] = str(tmp_path / "jobs")
    env.pop("NO_COLOR", None)
    return env


def test_the_first_lines_are_the_quick_starts() -> None:
    """The README's first command (install, then a real job) is made of quick-start steps,
    which the next test runs, and the whole suite's command comes next."""
    quick = [step for line in block("quickstart") for step in steps(line)]
    for step in first_commands():
        assert step in quick, f"{shlex.join(step)!r} is not a step of the quick start"
    head = (REPO / "README.md").read_text().splitlines()[:15]
    assert "    ./scripts/test" in head


@pytest.mark.slow  # real torch jobs
def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    env = quickstart_env(tmp_path)
    assert shutil.which("dtrain", path=env["PATH"]), "dtrain is not installed in the .venv"
    first_run = True
    for line in block("quickstart"):
        if all(is_install(step) for step in steps(line)):
            for step in steps(line):
                check_install(step)
            continue
        done = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=240,
        )  # fmt: skip
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{line}\n{output}"
        if first_run and line.startswith("dtrain run"):
            assert "warn" not in output.lower(), f"the first run warns:\n{output}"
            assert "final loss" in done.stdout, output
            first_run = False


def test_the_failure_sample_is_what_dtrain_prints(tmp_path: Path) -> None:
    """README's failing run: the same lines (ranks in any order, another job id), the same
    exit code."""
    lines = block("failure")
    runs: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("$ "):
            runs.append((line[2:], []))
        elif runs and not complete(runs[-1][0]):
            runs[-1] = (runs[-1][0] + "\n" + line, [])
        else:
            runs[-1][1].append(line)
    (command, expected), (echo, code) = runs
    assert echo == "echo $?"
    done = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=quickstart_env(tmp_path),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == int(code[0])
    got = sorted(JOB_ID.sub("JOB", line) for line in done.stdout.splitlines())
    assert got == sorted(JOB_ID.sub("JOB", line) for line in expected), done.stdout


def complete(command: str) -> bool:
    """Whether a shell command's quotes are all closed."""
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def sweep_table(lines: list[str]) -> list[dict[str, str]]:
    """A sweep's table as rows of named cells, without those that vary from run to run (the
    time a trial took, its job id)."""
    header, *rows = [line.split() for line in lines]
    varying = {"time", "job"}
    return [{k: v for k, v in zip(header, row, strict=True) if k not in varying} for row in rows]


@pytest.mark.slow  # six real torch trials
@pytest.mark.timeout(600)
def test_the_sweep_sample_is_what_dtrain_prints(tmp_path: Path) -> None:
    """docs/sweeps.md's example: the same table, row for row (best first), every figure the
    same; only the times and job ids differ."""
    lines = block("sweep", REPO / "docs" / "sweeps.md")
    assert lines[0].startswith("$ dtrain sweep ")
    command = lines[0][2:]
    rest = lines[1:]
    while command.endswith("\\"):
        command = command[:-1] + rest.pop(0).strip()
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    done = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=quickstart_env(tmp_path),
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sweep_table(done.stdout.splitlines()) == sweep_table(rest), done.stdout
