"""Slurm host lists and count lists: tables, and Slurm's own ``scontrol show hostnames`` as the
oracle over many generated lists (when Slurm's client is installed)."""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from launcher.base.errors import HostfileError
from launcher.core.hostlist import expand_counts, expand_hostlist
from launcher.core.hosts import Host, parse_host_list, parse_hostfile


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("node1", ["node1"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[001-3]", ["n001", "n002", "n003"]),  # padding from the bounds
        ("n[0-02]", ["n0", "n1", "n2"]),
        ("n[00-10]", [f"n{i:02d}" for i in range(11)]),
        ("n[1,01]", ["n1", "n01"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a[1-2][3-4]", ["a13", "a14", "a23", "a24"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # text after the bracket
        ("n[1-3],n[2-4]", ["n1", "n2", "n3", "n2", "n3", "n4"]),  # order kept, no de-duplication
        ("b,a,b", ["b", "a", "b"]),
    ],
)
def test_expand_hostlist(text: str, expected: list[str]) -> None:
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("n[]", "bad host range 'n[]': empty '[]'"),
        ("n[2-1]", "bad host range 'n[2-1]': range '2-1' goes down"),
        ("n[1", "bad host range 'n[1': missing ']'"),
        ("n]1", "']' without '['"),
        ("n[a-b]", "'a-b' is not a number or a range"),
        ("n[1-2[3]]", "nested '['"),
        ("a,,b", "empty item"),
        ("n[1-99999999]", "'n[1-99999999]' gives more than 100,000 hosts"),
        ("n[1-1000][1-1000][1-1000]", "gives more than 100,000 hosts"),  # counted, not made
        ("h" + "[0-9]" * 6, "gives more than 100,000 hosts"),
        ("n[1-60000],m[1-60000]", "'n[1-60000],m[1-60000]' gives more than 100,000 hosts"),
        ("n[1-1234567890123456789]", "has a number of over 18 digits"),
        ("n[\u0663]", "is not a number or a range"),  # an Arabic-Indic digit is not ASCII
    ],
)
def test_malformed_hostlists_name_the_token(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as caught:
        expand_hostlist(text)
    assert message in caught.value.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("8(x2)", [8, 8]), ("1,2,3", [1, 2, 3])],
)
def test_expand_counts(text: str, expected: list[int]) -> None:
    assert expand_counts(text) == expected


@pytest.mark.parametrize("text", ["2(x)", "x", "", "2(3)", "-1", "\u0663"])
def test_malformed_count_lists(text: str) -> None:
    with pytest.raises(HostfileError, match="bad item"):
        expand_counts(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1(x100001)", "more than 100,000 counts"),
        ("1(x60000),2(x60000)", "more than 100,000 counts"),
        ("9" * 5000, "has a number of over 18 digits"),  # int() would refuse 4,300 digits
    ],
)
def test_count_lists_are_bounded(text: str, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        expand_counts(text)


def test_the_limit_counts_names_before_making_them() -> None:
    assert len(expand_hostlist("h[1-3][1-3]", limit=9)) == 9
    with pytest.raises(HostfileError, match="'h\\[1-3\\]\\[1-3\\]' gives more than 8 hosts"):
        expand_hostlist("h[1-3][1-3]", limit=8)
    assert len(expand_hostlist("h[1-50000],g[1-50000]")) == 100_000  # the limit itself is fine


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (parse_host_list, "a[1-60000],b[1-60000]"),  # each item within the limit, not both
        (parse_hostfile, "a[1-60000] slots=1\nb[1-60000]\n"),
    ],
)
def test_a_whole_list_or_hostfile_is_bounded(parse: Callable[[str], object], text: str) -> None:
    with pytest.raises(HostfileError, match="more than 100,000 hosts"):
        parse(text)


def test_host_options_take_slurm_ranges() -> None:
    assert parse_host_list("node[01-03]:8,login") == [
        Host("node01", 8), Host("node02", 8), Host("node03", 8), Host("login"),
    ]  # fmt: skip
    assert parse_host_list("u@n[1-2]:2,[::1]:2") == [
        Host("n1", 2, user="u"), Host("n2", 2, user="u"), Host("::1", 2),
    ]  # fmt: skip
    assert parse_hostfile("gpu[1-2] slots=4 gpus=0,1,2,3\n") == [
        Host("gpu1", 4, gpus=("0", "1", "2", "3")), Host("gpu2", 4, gpus=("0", "1", "2", "3")),
    ]  # fmt: skip
    with pytest.raises(HostfileError, match=r"-H 'n\[3-1\]:2': bad host range"):
        parse_host_list("n[3-1]:2")


def random_hostlist(rng: random.Random) -> str:
    """A host list in the syntax Slurm 22.05 accepts (no text after the last bracket there)."""
    tokens = []
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(["n", "node", "gpu-", "rack"])
        for group in range(rng.randint(0, 2)):
            items = []
            for _ in range(rng.randint(1, 3)):
                low = rng.randint(0, 12)
                width = rng.choice([0, 0, 2, 3])
                high = low + rng.randint(0, 5)
                low_text = str(low).zfill(width)
                items.append(low_text if rng.random() < 0.3 else f"{low_text}-{high}")
            name += ("-x" if group else "") + "[" + ",".join(items) + "]"
        tokens.append(name)
    return ",".join(tokens)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
def test_expansion_matches_scontrol(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=dtraintest\nSlurmctldHost=localhost\n"
        "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=ALL Default=YES\n"
    )
    rng = random.Random(20261124)
    for _ in range(300):
        text = random_hostlist(rng)
        slurm = subprocess.run(
            ["scontrol", "show", "hostnames", text],
            capture_output=True,
            text=True,
            env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"},
            check=False,
        )
        assert slurm.returncode == 0, (text, slurm.stderr)
        assert expand_hostlist(text) == slurm.stdout.split(), text
