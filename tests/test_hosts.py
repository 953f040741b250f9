"""Table tests for launcher.core.hosts: whole lists of Host values in, errors by substring."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher.base.errors import HostfileError, UsageError
from launcher.core.hosts import Host, parse_host_list, parse_hostfile

HOSTFILES = Path(__file__).resolve().parent.parent / "hostfiles"

GPU_UUID = "GPU-8f3e2a6c-1b2d-4c5e-9f00-123456789abc"


def counted(name: str, user: str | None = None) -> Host:
    """A host whose slots are counted on it when the job starts (a bare hostfile line, as
    Open MPI 5 gives such a line the host's cores; ``host:*``)."""
    return Host(name, user=user, slots_on_host=True)


HOSTFILE_CASES: list[tuple[str, list[Host]]] = [
    # Open MPI / DeepSpeed
    ("node1 slots=4", [Host("node1", 4)]),
    ("node1 slots=4 max_slots=8", [Host("node1", 4, max_slots=8)]),
    ("node1 slots=4 max-slots=8", [Host("node1", 4, max_slots=8)]),
    ("node1 max_slots=8", [Host("node1", 8, max_slots=8)]),  # Open MPI: the limit is the slots
    ("node1 slots=4 max_slots=4", [Host("node1", 4, max_slots=4)]),
    ("node1 slots=04", [Host("node1", 4)]),
    ("node1 slots=8\nnode2 slots=8", [Host("node1", 8), Host("node2", 8)]),
    # Horovod / MPICH
    ("node1:4", [Host("node1", 4)]),
    ("node1:4\nnode2:2", [Host("node1", 4), Host("node2", 2)]),
    ("node1:4 max_slots=8", [Host("node1", 4, max_slots=8)]),
    ("node1:2 gpus=0,1", [Host("node1", 2, gpus=("0", "1"))]),
    # a bare name on one line: counted on the host (Open MPI 5: its cores); on several
    # lines: one slot a line (Open MPI: the same), in first-appearance order
    ("node1", [counted("node1")]),
    ("node1:*", [counted("node1")]),
    ("node[1-2]:*", [counted("node1"), counted("node2")]),
    ("[::1]:*", [counted("::1")]),
    ("a\na\nb", [Host("a", 2), counted("b")]),
    ("b\na\nb\nb", [Host("b", 3), counted("a")]),
    ("node1\nNODE1", [Host("node1", 2)]),
    # a repeated host adds its slots, counted or not (as Open MPI places them)
    ("node1 slots=2\nnode2\nnode1 slots=2", [Host("node1", 4), counted("node2")]),
    ("node1 slots=2\nnode1", [Host("node1", 3)]),
    ("node1\nnode1:2", [Host("node1", 3)]),
    ("node1:1\nnode1:1", [Host("node1", 2)]),
    ("Node1 slots=2\nnode1", [Host("Node1", 3)]),
    ("u@a:2\nu@a", [Host("a", 3, user="u")]),
    ("[::1]:2\n[0::1]", [Host("::1", 3)]),
    ("alice@a\nbob@a", [counted("a", user="alice"), counted("a", user="bob")]),
    ("a\nalice@a", [counted("a"), counted("a", user="alice")]),
    # comments, blank lines, whitespace, line endings
    ("# cluster\n\nnode1 slots=2  # big one\n   \n", [Host("node1", 2)]),
    ("  node1\tslots=2  ", [Host("node1", 2)]),
    ("node1#no space before comment", [counted("node1")]),
    ("node1 slots=2\r\nnode2 slots=2\r\n", [Host("node1", 2), Host("node2", 2)]),
    # users
    ("alice@node1 slots=2", [Host("node1", 2, user="alice")]),
    ("alice@node1:2", [Host("node1", 2, user="alice")]),
    ("a.b_c-d@node1", [counted("node1", user="a.b_c-d")]),
    # names and addresses
    ("127.0.0.1:2", [Host("127.0.0.1", 2)]),
    ("gpu-01.cluster.example.com", [counted("gpu-01.cluster.example.com")]),
    ("node_1", [counted("node_1")]),
    ("[fe80::1]", [counted("fe80::1")]),
    ("[::1]:4", [Host("::1", 4)]),
    ("user@[::1]:2", [Host("::1", 2, user="user")]),
    ("[::1] slots=2", [Host("::1", 2)]),
    ("[fe80::1%eth0]:2", [Host("fe80::1%eth0", 2)]),
    ("[::1]\n[0:0::1]", [Host("::1", 2)]),
    # GPUs
    ("node1 gpus=0,1,2,3", [Host("node1", 4, gpus=("0", "1", "2", "3"))]),
    ("node1 slots=2 gpus=2,3", [Host("node1", 2, gpus=("2", "3"))]),
    ("node1 slots=8 gpus=0", [Host("node1", 8, gpus=("0",))]),
    (f"node1 gpus={GPU_UUID}", [Host("node1", 1, gpus=(GPU_UUID,))]),
    ("node1 gpus=3,1", [Host("node1", 2, gpus=("3", "1"))]),
    ("node1 gpus=0,1 max_slots=4", [Host("node1", 2, max_slots=4, gpus=("0", "1"))]),
]


@pytest.mark.parametrize(("text", "expected"), HOSTFILE_CASES)
def test_parse_hostfile(text: str, expected: list[Host]) -> None:
    assert parse_hostfile(text, "hosts") == expected


HOSTFILE_ERRORS: list[tuple[str, str]] = [
    # the documented example, verbatim
    ("a\nb\nnode1 slots=x", "hosts:3: 'node1 slots=x': slots must be a positive integer"),
    # nothing to run on
    ("", "hosts: no hosts"),
    ("# only a comment\n\n   \n", "hosts: no hosts"),
    # counts
    ("node1 slots=0", "hosts:1: 'node1 slots=0': slots must be a positive integer"),
    ("node1 slots=-1", "slots must be a positive integer"),
    ("node1 slots=+4", "slots must be a positive integer"),
    ("node1 slots=4.0", "slots must be a positive integer"),
    ("node1 slots=", "slots must be a positive integer"),
    ("node1 slots=\u0663", "slots must be a positive integer"),  # Arabic-Indic 3
    ("node1 slots=1e3", "slots must be a positive integer"),
    ("node1:x", "hosts:1: 'node1:x': slots must be a positive integer"),
    ("node1:", "slots must be a positive integer"),
    ("node1:0", "slots must be a positive integer"),
    ("node1 slots=" + "9" * 5000, "slots is larger than 100000"),
    ("node1 max_slots=0", "max_slots must be a positive integer"),
    ("node1 max-slots=x", "max_slots must be a positive integer"),
    ("node1 slots=4 max_slots=2", "max_slots (2) is less than slots (4)"),
    ("node1 gpus=0,1,2 max_slots=2", "max_slots (2) is less than slots (3)"),
    # keys
    ("node1 count=4", "unknown key 'count'; allowed: slots, max_slots, max-slots, gpus"),
    ("node1 Slots=4", "unknown key 'Slots'"),
    ("node1 =4", "unknown key ''"),
    ("node1 slots = 4", "expected key=value after the host, got 'slots'"),
    ("node1 slots", "expected key=value after the host, got 'slots'"),
    ("node1 slots=2 slots=4", "slots given twice"),
    ("node1 max_slots=2 max-slots=4", "max_slots given twice"),
    ("node1 gpus=0 gpus=1", "gpus given twice"),
    ("node1:4 slots=4", "hosts:1: 'node1:4 slots=4': slots given twice, as ':4' and as 'slots='"),
    # repeats that cannot add up (a limit or GPU ids), naming both lines
    (
        "node1 slots=2\nnode2\nnode1 gpus=0",
        "hosts:3: 'node1 gpus=0': host 'node1' is listed twice (first at hosts:1: "
        "'node1 slots=2'), with max_slots, gpus or ':*'",
    ),
    ("node1\nnode1 max_slots=4", "host 'node1' is listed twice"),
    ("node1:*\nnode1", "host 'node1' is listed twice"),  # a count of its own cannot add up
    ("node1\nnode1:*", "host 'node1' is listed twice"),
    ("node1:* slots=2", "':*' (slots counted on the host) with slots"),
    ("node1 gpus=0\nnode1", "host 'node1' is listed twice"),
    ("Node1 max_slots=2\nnode1", "host 'node1' is listed twice (first at hosts:1: "),
    # users
    ("@node1", "hosts:1: '@node1': empty user before '@'"),
    ("a@b@node1", "invalid user name 'a@b'"),
    ("-oProxyCommand=x@node1", "invalid user name"),
    ("alice@", "hosts:1: 'alice@': no host name"),
    ("alice@:4", "no host name"),
    (":4", "no host name"),
    # names
    ("-oProxyCommand=x", "invalid host name '-oProxyCommand=x'"),
    ("node/1", "invalid host name 'node/1'"),
    ("nöde1", "invalid host name"),
    ("slots=4", "invalid host name 'slots=4'"),
    ("999.1.1.1", "invalid IPv4 address '999.1.1.1'"),
    ("1.2.3", "invalid IPv4 address"),
    # IPv6 needs brackets
    ("::1", "hosts:1: '::1': more than one ':' in '::1'"),
    ("fe80::1:4", "more than one ':'"),
    ("node1:4:5", "more than one ':'"),
    ("[::1", "missing ']'"),
    ("[::1]4", "unexpected '4' after ']'"),
    ("[]:4", "no address inside '[]'"),
    ("[node1]:4", "invalid IPv6 address 'node1'"),
    ("[10.0.0.1]", "invalid IPv6 address"),
    ("[fe80::1%a/b]", "invalid IPv6 address"),
    ("[::1]:x", "slots must be a positive integer"),
    # GPUs
    ("node1 gpus=", "empty GPU id"),
    ("node1 gpus=0,,1", "empty GPU id in gpus='0,,1'"),
    ("node1 gpus=0,1,", "empty GPU id"),
    ("node1 gpus=0,1,0", "GPU id '0' listed twice"),
    ("node1 gpus=0;1", "invalid GPU id '0;1'"),
    ("node1 gpus=-1", "invalid GPU id '-1'"),
]


@pytest.mark.parametrize(("text", "message"), HOSTFILE_ERRORS)
def test_parse_hostfile_errors(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as caught:
        parse_hostfile(text, "hosts")
    assert message in caught.value.message
    assert caught.value.hint, "every error says how to fix it"


def test_error_carries_hint_and_usage_exit_code() -> None:
    with pytest.raises(HostfileError) as caught:
        parse_hostfile("node1 slots=x", "hosts")
    error = caught.value
    assert isinstance(error, UsageError)
    assert error.exit_code == UsageError.exit_code
    assert error.message == "hosts:1: 'node1 slots=x': slots must be a positive integer"
    assert error.hint == "write e.g. 'node1 slots=4'"


def test_error_line_numbers_count_comments_and_blank_lines() -> None:
    text = "# header\n\nnode1 slots=2\n\n# more\nnode2 slots=x\n"
    with pytest.raises(HostfileError, match=r"^hosts:6: 'node2 slots=x'"):
        parse_hostfile(text, "hosts")


def test_error_quotes_long_lines_shortened() -> None:
    with pytest.raises(HostfileError) as caught:
        parse_hostfile("node1 slots=x " + "y" * 10_000, "hosts")
    assert "y" * 100 not in caught.value.message


def test_default_source_names_the_hostfile() -> None:
    with pytest.raises(HostfileError, match=r"^<hostfile>:1: "):
        parse_hostfile("node1 slots=x")


HOST_LIST_CASES: list[tuple[str, list[Host]]] = [
    ("node1", [Host("node1")]),  # a bare -H item is 1 slot (Open MPI 5: the same)
    ("node1:*", [counted("node1")]),  # the host's own count, as mpirun's -H node1:*
    ("a:*,b:2", [counted("a"), Host("b", 2)]),
    ("a:4,b:4", [Host("a", 4), Host("b", 4)]),
    ("a,a,b", [Host("a", 2), Host("b", 1)]),
    ("b,a,b", [Host("b", 2), Host("a", 1)]),
    ("a,A", [Host("a", 2)]),
    (" a:2 , b ,\tc:1 ", [Host("a", 2), Host("b"), Host("c", 1)]),
    ("user@a:2", [Host("a", 2, user="user")]),
    ("user@a,a", [Host("a", user="user"), Host("a")]),
    ("[::1]:2", [Host("::1", 2)]),
    ("[::1],[::1]", [Host("::1", 2)]),
    ("u@[fe80::1]:3,127.0.0.1:1", [Host("fe80::1", 3, user="u"), Host("127.0.0.1", 1)]),
    ("localhost:8", [Host("localhost", 8)]),
    ("node01:2,node01", [Host("node01", 3)]),  # the example: 3 slots, as mpirun
    ("a,a:2", [Host("a", 3)]),
    ("a:2,b,A:2", [Host("a", 4), Host("b")]),
]


@pytest.mark.parametrize(("spec", "expected"), HOST_LIST_CASES)
def test_parse_host_list(spec: str, expected: list[Host]) -> None:
    assert parse_host_list(spec) == expected


HOST_LIST_ERRORS: list[tuple[str, str]] = [
    ("", "-H: no hosts"),
    ("  ", "-H: no hosts"),
    ("a,,b", "-H 'a,,b': item 2 is empty"),
    ("a,b,", "-H 'a,b,': item 3 is empty"),
    (",a", "item 1 is empty"),
    ("a, ,b", "item 2 is empty"),
    ("a:x", "-H 'a:x': slots must be a positive integer"),
    ("a:**", "slots must be a positive integer"),
    ("a:*,a", "host 'a' is listed twice"),
    ("a:0", "slots must be a positive integer"),
    ("a:-2", "slots must be a positive integer"),
    ("::1", "more than one ':'"),
    ("[::1", "missing ']'"),
    ("a b", "invalid host name 'a b'"),
    ("a slots=2", "invalid host name"),
    ("@a", "empty user before '@'"),
    ("u@", "no host name"),
    ("a;b", "invalid host name"),
]


@pytest.mark.parametrize(("spec", "message"), HOST_LIST_ERRORS)
def test_parse_host_list_errors(spec: str, message: str) -> None:
    with pytest.raises(HostfileError) as caught:
        parse_host_list(spec)
    assert message in caught.value.message
    assert caught.value.hint


def test_a_discovery_scripts_bare_line_is_one_slot() -> None:
    """Hosts a discovery script prints come and go between surveys: a bare line is 1 slot
    (horovodrun's reading), and ``host:*`` has no meaning there."""
    assert parse_hostfile("a\nb:2", "discover", bare_on_host=False) == [Host("a"), Host("b", 2)]
    with pytest.raises(HostfileError, match="slots must be a positive integer"):
        parse_hostfile("a:*", "discover", bare_on_host=False)


def test_host_list_source_names_the_option() -> None:
    with pytest.raises(HostfileError, match=r"^--hosts 'a:x': "):
        parse_host_list("a:x", source="--hosts")


def test_hostfile_and_host_list_agree() -> None:
    assert parse_hostfile("a:4\nu@b:2\n[::1]:1\nc\nc") == parse_host_list("a:4,u@b:2,[::1]:1,c,c")


@pytest.mark.parametrize(
    ("host", "target"),
    [
        (Host("node1"), "node1"),
        (Host("node1", 4, user="alice"), "alice@node1"),
        (parse_host_list("bob@[::1]:2")[0], "bob@::1"),
    ],
)
def test_ssh_target(host: Host, target: str) -> None:
    assert host.ssh_target == target


# --- the example hostfiles -------------------------------------------------

EXAMPLES: dict[str, list[Host]] = {
    "openmpi.txt": [
        Host("node1", 4, max_slots=8),
        Host("node2", 4, max_slots=8),
        Host("node3", 2, user="alice"),
        Host("fe80::1", 2),
    ],
    "deepspeed.txt": [Host(f"node{i}", 8) for i in range(1, 5)],
    "horovod.txt": [
        Host("node1", 4),
        Host("node2", 4),
        Host("127.0.0.1", 2, user="bob"),
        Host("::1", 2),
        Host("node4", 2, gpus=("0", "1")),
    ],
    "plain.txt": [Host("localhost", 2), counted("node1"), counted("node2")],
    "gpus.txt": [
        Host("node1", 4, gpus=("0", "1", "2", "3")),
        Host("node2", 2, gpus=("2", "3")),
        Host("node3", 1, gpus=(GPU_UUID,)),
    ],
}


@pytest.mark.parametrize("path", sorted(HOSTFILES.iterdir()), ids=lambda path: path.name)
def test_every_example_hostfile_parses(path: Path) -> None:
    hosts = parse_hostfile(path.read_text(encoding="utf-8"), path.name)
    assert hosts
    assert path.read_text(encoding="utf-8").lstrip().startswith("#"), "examples are commented"


@pytest.mark.parametrize(("name", "expected"), EXAMPLES.items())
def test_example_hostfile_contents(name: str, expected: list[Host]) -> None:
    assert parse_hostfile((HOSTFILES / name).read_text(encoding="utf-8"), name) == expected


# --- properties --------------------------------------------------------------

# Characters that matter to the grammar, so the fuzzer reaches deep paths often.
_GRAMMAR_TOKENS = [*"ab1:@[]=,#. \t\n\r-_%fe0x", "slots=", "max_slots=", "gpus=", "::1"]
_GRAMMAR_TEXT = st.lists(st.sampled_from(_GRAMMAR_TOKENS), max_size=40).map("".join)
_ANY_TEXT = st.text(max_size=200)


def _parse_or_error(parse: Callable[[str], list[Host]], text: str) -> list[Host] | HostfileError:
    try:
        return parse(text)
    except HostfileError as error:
        return error


def _check_outcome(outcome: list[Host] | HostfileError, prefix: str) -> None:
    """Either a clean error that says where and how to fix, or sane hosts."""
    if isinstance(outcome, HostfileError):
        assert outcome.message.startswith(prefix)
        assert outcome.hint
        return
    assert outcome
    for host in outcome:
        assert isinstance(host, Host)
        assert host.slots >= 1
        assert host.max_slots is None or host.max_slots >= host.slots
        assert host.name
        assert not host.name.startswith(("-", "["))
        assert host.user is None or host.user


@given(st.one_of(_ANY_TEXT, _GRAMMAR_TEXT))
def test_parse_hostfile_raises_only_hostfile_error(text: str) -> None:
    _check_outcome(_parse_or_error(lambda t: parse_hostfile(t, "fuzz"), text), "fuzz")


@given(st.one_of(_ANY_TEXT, _GRAMMAR_TEXT))
def test_parse_host_list_raises_only_hostfile_error(spec: str) -> None:
    _check_outcome(_parse_or_error(parse_host_list, spec), "-H")


_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True)


@given(st.dictionaries(_NAMES, st.integers(1, 64), min_size=1, max_size=6))
def test_rendered_hosts_parse_back(slots_by_name: dict[str, int]) -> None:
    expected = [Host(name, slots) for name, slots in slots_by_name.items()]
    openmpi = "\n".join(f"{name} slots={slots}" for name, slots in slots_by_name.items())
    horovod = ",".join(f"{name}:{slots}" for name, slots in slots_by_name.items())
    bare = "\n".join(name for name, slots in slots_by_name.items() for _ in range(slots))
    assert parse_hostfile(openmpi) == expected
    assert parse_host_list(horovod) == expected
    # one bare line: counted on the host; more: one slot a line
    assert parse_hostfile(bare) == [h if h.slots > 1 else counted(h.name) for h in expected]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a..b", "-H 'a..b': invalid host name 'a..b': empty or over-long part"),
        (".a", "-H '.a': invalid host name '.a'"),
        ("x" * 64 + ".b", "empty or over-long part between dots"),
        ("n" * 300, "is longer than 253 characters"),
    ],
)
def test_host_names_must_be_dns_shaped(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as caught:
        parse_host_list(text)
    assert message in caught.value.message


def test_a_huge_name_or_gpu_list_is_answered_at_once() -> None:
    with pytest.raises(HostfileError, match="longer than 253"):
        parse_host_list("a" * 20_000_000)
    gpus = ",".join(str(i) for i in range(200_000))
    (host,) = parse_hostfile(f"node1 gpus={gpus}\n")
    assert host.gpus is not None and len(host.gpus) == 200_000
    with pytest.raises(HostfileError, match="listed twice"):
        parse_hostfile(f"node1 gpus={gpus},5\n")
