"""Real multi-host SSH test fixtures: N OpenSSH ``sshd`` daemons as "hosts".

Stdlib only.  Two modes:

``netns`` (root, ``ip`` and ``unshare`` available; the mode that matters)
    Host ``nodeK`` is a network namespace ``dtrain-nodeK`` with address
    ``198.18.0.(10+K)/24`` on ``eth0``, a veth pair whose other end
    (``dtv-nodeK``) is enslaved to the bridge ``dtrain-br0`` (198.18.0.1/24) in
    the root namespace (lane 0's names and addresses; see below for the others).
    The launcher (root namespace) reaches every node and the nodes reach each
    other through the bridge.  Each ``sshd`` also runs in its own UTS namespace,
    so ``ssh node2 hostname`` prints ``node2``.

``loopback`` (fallback)
    Host ``nodeK`` is an ``sshd`` on ``127.0.0.(K+1)``: port 22 when root,
    otherwise a free high port.  When root and ``unshare`` works, each sshd
    still gets its own UTS namespace (hostname ``nodeK``); otherwise all hosts
    share the machine's hostname.

Everything (host keys, client key, ``ssh_config``, ``known_hosts``,
``authorized_keys``, sshd configs, pid files and logs) lives in one state
directory.  ``stop()`` is idempotent; ``cleanup_leftovers()`` (also run by
``start()`` in netns mode) removes what a crashed previous run left behind.

Usage::

    with TestHosts(3) as hosts:
        hosts.run("node2", "hostname").stdout  # 'node2\\n'
        subprocess.run(["ssh", "-F", str(hosts.ssh_config), "node1", "true"])

One set of netns test hosts can exist per lane (``LANE``: one per pytest-xdist
worker, 0 outside xdist), whose names and addresses are its own: lane 2's node3
is the namespace ``dtrain2-node3`` at 198.18.2.13 on the bridge ``dtrain-br2``.
``start()`` takes an exclusive ``flock`` on the lane's ``LOCK_PATH`` held until
``stop()``, so concurrent test runs in one lane queue instead of destroying each
other's hosts.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, Literal

__all__ = [
    "BRIDGE",
    "BRIDGE_ADDRESS",
    "NETNS_PREFIX",
    "TestHosts",
    "TestHostsError",
    "cleanup_leftovers",
    "netns_available",
    "netns_name",
    "pid_alive",
    "processes_in",
    "sshd_path",
    "unavailable_reason",
]


def _lane() -> int:
    """Which set of test hosts this process runs: one per pytest-xdist worker (``gwN``: lane
    N+1), each with namespaces, bridge, addresses, state folders and lock of its own, so that
    the workers run host tests side by side; 0 outside xdist (``scripts/testhosts``, a
    single pytest process).  ``DTRAIN_TEST_LANE`` chooses one (0..199)."""
    given = os.environ.get("DTRAIN_TEST_LANE", "")
    if given.isdigit():
        return int(given)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    return int(worker) + 1 if worker.isdigit() else 0


LANE = _lane()
_TAG = str(LANE) if LANE else ""  # lane 0's names are those of a single run: dtrain-node3
NETNS_PREFIX = f"dtrain{_TAG}-"  # namespace of host "node3" is "dtrain-node3" (lane 2: dtrain2-)
BRIDGE = f"dtrain-br{LANE}"
VETH_PREFIX = f"dtv{_TAG}-"  # root-namespace end of node3's veth pair: "dtv-node3"
SUBNET = f"198.18.{LANE}"  # RFC 2544 benchmarking range (198.18.0.0/15), never routed
BRIDGE_ADDRESS = f"{SUBNET}.1"
STATE_PREFIX = f"dtrain-testhosts{_TAG}-"  # the state folder, in the temporary folder
PREFIX_LEN = 24
NODE_OFFSET = 10  # node K -> 198.18.LANE.(10+K)
MAX_HOSTS = 200
SSHD_CONFIG_NAME = "dtrain_sshd_config"  # marks our daemons in /proc/*/cmdline
MARKER_NAME = "testhosts.json"  # marks a state dir as ours (safe to rmtree)
# root-owned hosts (netns names, port 22) are machine-global, one set per lane; non-root
# ones use free ports, so a per-user lock is enough
LOCK_PATH = Path(tempfile.gettempdir()) / (
    f"dtrain-testhosts{_TAG}.lock" if os.geteuid() == 0 else f"dtrain-testhosts-{os.geteuid()}.lock"
)
PRIVSEP_DIR = Path("/run/sshd")
SFTP_SERVER_CANDIDATES = ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server")
# Setting up 64 hosts one command after another took 4.5 s (stopping them 2.5 s): most of it
# starting `ip` and `ssh-keygen` processes. Their work is independent per host, so a few run
# at once (the kernel's rtnl lock serialises the netlink part anyway).
SETUP_WORKERS = 8

Mode = Literal["netns", "loopback"]


class TestHostsError(RuntimeError):
    """Setting up or talking to the test hosts failed."""

    __test__ = False  # not a pytest test class despite the name


# --------------------------------------------------------------------------
# environment probes


def sshd_path() -> str | None:
    """Absolute path of the OpenSSH server binary, or None."""
    for candidate in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("sshd")


def _is_root() -> bool:
    return os.geteuid() == 0


def netns_available() -> bool:
    """True when the netns mode can be used (root, ``ip``, ``unshare``)."""
    return _is_root() and shutil.which("ip") is not None and shutil.which("unshare") is not None


def unavailable_reason() -> str | None:
    """Why test hosts cannot run here at all (any mode), or None if they can."""
    if sshd_path() is None:
        return "OpenSSH server (sshd) not installed; run scripts/install-test-deps.sh"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not installed; run scripts/install-test-deps.sh"
    return None


def netns_name(name: str) -> str:
    """Network namespace of host ``name`` (``node1`` -> ``dtrain-node1``)."""
    return f"{NETNS_PREFIX}{name}"


def _run(
    args: Sequence[str], *, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), input=input, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise TestHostsError(
            f"command failed ({proc.returncode}): {shlex.join(args)}\n{proc.stderr.strip()}"
        )
    return proc


def processes_in(name: str) -> list[int]:
    """Pids of all processes in host ``name``'s network namespace (netns mode).

    Accepts a host name (``node2``) or a full namespace name
    (``dtrain-node2``).  Returns [] when the namespace does not exist.
    """
    ns = name if name.startswith(NETNS_PREFIX) else netns_name(name)
    if shutil.which("ip") is None:
        return []
    proc = _run(["ip", "netns", "pids", ns], check=False)
    if proc.returncode != 0:
        return []
    return sorted(int(tok) for tok in proc.stdout.split() if tok.isdigit())


def _each_host(call: Callable[[str], object], names: Iterable[str]) -> None:
    """``call(name)`` for every host, a few at once; the first error is raised."""
    todo = list(names)
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=min(SETUP_WORKERS, len(todo))) as pool:
        for _ in pool.map(call, todo):
            pass


def _ip_batch(lines: Sequence[str], *, namespace: str | None = None, force: bool = False) -> None:
    """Many ``ip`` commands in one process (``ip -batch``); ``namespace``: inside it (``ip -n``);
    ``force``: go on past a failing line (what is being removed may be gone already)."""
    if not lines:
        return
    argv = ["ip", *(["-n", namespace] if namespace else []), *(["-force"] if force else [])]
    _run([*argv, "-batch", "-"], input="\n".join(lines) + "\n", check=not force)


def _list_netns() -> list[str]:
    if shutil.which("ip") is None:
        return []
    proc = _run(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        return []
    # lines look like "dtrain-node1 (id: 3)" or just "dtrain-node1"
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _link_exists(name: str) -> bool:
    return _run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def _list_links(prefix: str) -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names: list[str] = []
    for line in proc.stdout.splitlines():
        # "12: dtv-node1@if2: <BROADCAST,...> ..."
        parts = line.split(":", 2)
        if len(parts) >= 2:
            link = parts[1].strip().split("@", 1)[0]
            if link.startswith(prefix):
                names.append(link)
    return names


# --------------------------------------------------------------------------
# process helpers


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state != b"Z"
    except (OSError, IndexError):
        return False


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid``'s descendants; ``children``: one ``_children_map()`` for many calls (each
    call otherwise reads all of /proc)."""
    children = _children_map() if children is None else children
    out: list[int] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _our_sshd_pids(state_dir: Path | None = None) -> list[int]:
    """sshd masters started by this module (any run of this lane, or one state dir)."""
    pids: list[int] = []
    needle = SSHD_CONFIG_NAME.encode()
    scope = str(state_dir if state_dir is not None else f"/{STATE_PREFIX}").encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if not argv or not argv[0].endswith(b"sshd"):
            continue
        if any(needle in arg and scope in arg for arg in argv[1:]):
            pids.append(int(entry))
    return pids


def _ns_id(pid: int, kind: str) -> str | None:
    """``/proc/PID/ns/KIND`` link text (e.g. ``uts:[4026532301]``), or None."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _pids_in_ns(kind: str, ns_id: str) -> list[int]:
    """All live pids whose ``kind`` namespace is ``ns_id``."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_id(int(entry), kind) == ns_id and pid_alive(int(entry)):
            pids.append(int(entry))
    return sorted(pids)


def _kill_all(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``grace`` seconds."""
    pids = [p for p in pids if p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if pid_alive(p)]
            if not pids:
                return
            time.sleep(0.05)


def _kill_netns_processes(ns: str) -> None:
    _kill_in_namespaces([ns])


def _pids_in_netns(inodes: set[int]) -> list[int]:
    """Live pids whose network namespace is one of ``inodes`` (one pass over /proc)."""
    wanted = {f"net:[{inode}]" for inode in inodes}
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_id(int(entry), "net") in wanted and pid_alive(int(entry)):
            pids.append(int(entry))
    return sorted(pids)


def _kill_in_namespaces(namespaces: Sequence[str]) -> None:
    """Kill every process in these network namespaces (``ip netns pids`` for all of them
    at once: one pass over /proc, not one ``ip`` per namespace)."""
    inodes = set()
    for ns in namespaces:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/run/netns/{ns}").st_ino)
    if not inodes:
        return
    for _ in range(5):  # processes may fork while we kill
        pids = _pids_in_netns(inodes)
        if not pids:
            return
        _kill_all(pids, grace=0.0)


def _remove_network(namespaces: Sequence[str]) -> None:
    """Kill what runs in ``namespaces``, delete them, their veths and the bridge (what is
    already gone is skipped)."""
    _kill_in_namespaces(namespaces)
    present = set(_list_netns())
    lines = [f"netns delete {ns}" for ns in namespaces if ns in present]
    # a namespace's deletion takes its veth pair along; a veth left without one does not
    veths = {f"{VETH_PREFIX}{ns.removeprefix(NETNS_PREFIX)}" for ns in namespaces}
    lines += [f"link delete dev {link}" for link in _list_links(VETH_PREFIX) if link in veths]
    if _link_exists(BRIDGE):
        lines.append(f"link delete dev {BRIDGE}")
    _ip_batch(lines, force=True)


def cleanup_leftovers() -> None:
    """Remove every trace of netns test hosts on this machine.

    Kills all processes inside ``dtrain-node*`` namespaces, deletes those
    namespaces, ``dtv-node*`` veths and the ``dtrain-br0`` bridge, and kills
    sshd daemons started by this module (recognised by their config file
    name) in any mode.  Safe to call when nothing is there.  State dirs of
    crashed runs are not known here and are left alone.
    """
    if shutil.which("ip") is not None and _is_root():
        ours = [ns for ns in _list_netns() if ns.startswith(f"{NETNS_PREFIX}node")]
        ours += [  # veths whose namespace is gone
            netns_name(link.removeprefix(VETH_PREFIX))
            for link in _list_links(f"{VETH_PREFIX}node")
            if netns_name(link.removeprefix(VETH_PREFIX)) not in ours
        ]
        _remove_network(ours)
    masters = _our_sshd_pids()
    if masters:
        tree = set(masters)
        children = _children_map()
        for pid in masters:
            tree.update(_descendants(pid, children))
        _kill_all(sorted(tree))


# --------------------------------------------------------------------------
# the fixture


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class TestHosts:
    """N real sshd "hosts" named ``node1`` .. ``nodeN``.

    ``netns=None`` picks the netns mode when available, else loopback;
    ``True``/``False`` force a mode (``True`` raises if unavailable).
    A given ``state_dir`` is created if needed and removed by ``stop()`` only
    if it is empty or was populated by this class (it holds ``testhosts.json``).
    """

    __test__ = False  # not a pytest test class despite the name
    _active_in_process: TestHosts | None = None  # holder of the lock here

    def __init__(
        self,
        count: int,
        state_dir: Path | None = None,
        *,
        netns: bool | None = None,
        start_timeout: float = 20.0,
        lock_timeout: float = 600.0,
    ) -> None:
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"count must be in 1..{MAX_HOSTS}, got {count}")
        if netns and not netns_available():
            raise TestHostsError("netns mode needs root, `ip` and `unshare`")
        self.count = count
        self.netns: bool = netns_available() if netns is None else netns
        self._state_dir_arg = Path(state_dir).resolve() if state_dir is not None else None
        self._state_dir: Path | None = None
        self.start_timeout = start_timeout
        self.lock_timeout = lock_timeout
        self.names: list[str] = [f"node{k}" for k in range(1, count + 1)]
        self.addresses: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}  # host -> sshd master pid
        self.uts: bool = False  # each host has its own hostname
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._uts_ns: dict[str, str] = {}  # host -> "uts:[inode]" (loopback+uts)
        self._lock_fh: IO[str] | None = None
        self._started = False

    # ----------------------------------------------------------- properties

    @property
    def mode(self) -> Mode:
        return "netns" if self.netns else "loopback"

    @property
    def state_dir(self) -> Path:
        if self._state_dir is None:
            raise TestHostsError("test hosts not started")
        return self._state_dir

    @property
    def ssh_config(self) -> Path:
        """Client config naming the hosts; use ``ssh -F ssh_config nodeK``."""
        return self.state_dir / "ssh_config"

    @property
    def identity(self) -> Path:
        """Client private key (ed25519, no passphrase)."""
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def authorized_keys(self) -> Path:
        return self.state_dir / "authorized_keys"

    @property
    def ssh_command(self) -> list[str]:
        """argv prefix for reaching the hosts: ``[*ssh_command, host, cmd]``."""
        return ["ssh", "-F", str(self.ssh_config)]

    @property
    def started(self) -> bool:
        return self._started

    def host_dir(self, name: str) -> Path:
        return self.state_dir / name

    def log_path(self, name: str) -> Path:
        """sshd log (stderr of ``sshd -D -e``) of host ``name``."""
        return self.host_dir(name) / "sshd.log"

    def hostfile_text(self, slots: int = 1) -> str:
        """Open MPI style hostfile (``nodeK slots=N``) listing all hosts."""
        return "".join(f"{name} slots={slots}\n" for name in self.names)

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> TestHosts:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> TestHosts:
        """Create keys, configs, (namespaces,) and start the daemons.

        Returns once every sshd accepts TCP connections.  On failure
        everything set up so far is torn down before the error propagates.
        """
        if self._started:
            return self
        reason = unavailable_reason()
        if reason:
            raise TestHostsError(reason)
        self._acquire_lock()
        self._started = True
        atexit.register(self.stop)
        try:
            self._make_state_dir()
            if self.netns:
                cleanup_leftovers()
                self._setup_network()
            else:
                self._choose_loopback_addresses()
            self._generate_keys()
            self._write_client_files()
            self._start_daemons()
            self._wait_ready()
            self._write_marker()
        except BaseException:
            self.stop()
            raise
        return self

    def detach(self) -> Path:
        """Leave the hosts running after this process exits (for the
        ``scripts/testhosts up`` CLI); returns the state dir.  Releases the
        lock, so a later ``start()`` in netns mode will clean them up as
        leftovers.  Tear down with ``TestHosts.attach(state_dir).stop()``."""
        state = self.state_dir
        atexit.unregister(self.stop)
        self._procs.clear()
        self._started = False
        self._release_lock()
        return state

    @classmethod
    def attach(cls, state_dir: Path) -> TestHosts:
        """Re-create the handle of running hosts from their state dir."""
        state_dir = Path(state_dir).resolve()
        try:
            info = json.loads((state_dir / MARKER_NAME).read_text())
        except (OSError, ValueError) as exc:
            raise TestHostsError(f"{state_dir} is not a test hosts state dir: {exc}") from exc
        names: list[str] = list(info["names"])
        self = cls(len(names), state_dir, netns=info.get("mode") == "netns")
        self.names = names
        self._state_dir = state_dir
        self.addresses = dict(info.get("addresses", {}))
        self.ports = {k: int(v) for k, v in info.get("ports", {}).items()}
        self.pids = {k: int(v) for k, v in info.get("pids", {}).items()}
        self._uts_ns = dict(info.get("uts_ns", {}))
        self.uts = bool(info.get("uts", False))
        self._started = True  # stop() works; no lock held
        return self

    def stop(self) -> None:
        """Kill daemons and sessions, delete namespaces/links, remove state.

        Idempotent; never raises for things that are already gone.
        """
        if not self._started:
            return
        try:
            atexit.unregister(self.stop)
            victims: set[int] = set(self.pids.values())
            children = _children_map()
            for pid in list(victims):
                victims.update(_descendants(pid, children))
            for uts in self._uts_ns.values():
                victims.update(_pids_in_ns("uts", uts))
            if self._state_dir is not None:
                for pid in _our_sshd_pids(self._state_dir):
                    victims.add(pid)
                    victims.update(_descendants(pid, children))
            _kill_all(sorted(victims))
            for proc in self._procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            for uts in self._uts_ns.values():  # stragglers forked meanwhile
                for _ in range(5):
                    left = _pids_in_ns("uts", uts)
                    if not left:
                        break
                    _kill_all(left, grace=0.0)
            self._procs.clear()
            self.pids.clear()
            self._uts_ns.clear()
            if self.netns:
                _remove_network([netns_name(name) for name in self.names])
            self._remove_state_dir()
        finally:
            self._started = False
            self._release_lock()

    # --------------------------------------------------------------- remote

    def run(
        self,
        name: str,
        command: str | Sequence[str],
        *,
        timeout: float | None = 60.0,
        check: bool = False,
        input: str | None = None,
        ssh_options: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on host ``name`` via ``ssh -F ssh_config``.

        A string is passed to the remote shell as is; a sequence is quoted
        with ``shlex.join``.  Output is captured as text.
        """
        if name not in self.names:
            raise KeyError(f"unknown test host {name!r}; have {self.names}")
        remote = command if isinstance(command, str) else shlex.join(command)
        argv = [*self.ssh_command, *ssh_options, name, remote]
        return subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            stdin=None if input is not None else subprocess.DEVNULL,
        )

    @contextlib.contextmanager
    def shaped(self, name: str, rate: str = "50mbit") -> Iterator[None]:
        """Slow host ``name``'s link both ways with a token bucket (``tc qdisc ... tbf``) on
        both ends of its veth pair, as a bad cable or a misnegotiated NIC would; removed on
        exit.  netns mode only (loopback hosts share one link)."""
        if self.mode != "netns":
            raise TestHostsError("shaping a link needs the netns test hosts")
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        ends = [  # to the host (the bridge's side), from the host (inside its namespace)
            (["tc", "qdisc"], f"{VETH_PREFIX}{name}"),
            (["ip", "netns", "exec", netns_name(name), "tc", "qdisc"], "eth0"),
        ]
        for tc, dev in ends:
            _run([*tc, "replace", "dev", dev, *tbf])
        try:
            yield
        finally:
            for tc, dev in ends:
                _run([*tc, "del", "dev", dev, "root"], check=False)

    def processes(self, name: str) -> list[int]:
        """Pids on host ``name``: all processes in its network namespace
        (netns mode) or its UTS namespace (loopback mode as root); otherwise
        the host's sshd master and its descendants (misses daemons that
        re-parent themselves to init)."""
        if self.netns:
            return processes_in(name)
        uts = self._uts_ns.get(name)
        if uts is not None:
            return _pids_in_ns("uts", uts)
        pid = self.pids.get(name)
        if pid is None or not pid_alive(pid):
            return []
        return sorted([pid, *_descendants(pid)])

    def running(self, needles: Sequence[bytes]) -> dict[str, list[int]]:
        """Host -> pids on it whose command line holds one of ``needles``."""
        found: dict[str, list[int]] = {}
        for name in self.names:
            for pid in self.processes(name):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if any(needle in cmdline for needle in needles):
                    found.setdefault(name, []).append(pid)
        return found

    def leftovers(self) -> list[int]:
        """Pids on any host other than its sshd master (netns mode: one pass over /proc for
        every host, where ``processes`` costs an ``ip`` per host): what a job left behind."""
        if not self.netns:
            found = {pid for name in self.names for pid in self.processes(name)}
        else:
            inodes = set()
            for name in self.names:
                with contextlib.suppress(OSError):
                    inodes.add(os.stat(f"/run/netns/{netns_name(name)}").st_ino)
            found = set(_pids_in_netns(inodes))
        return sorted(found - set(self.pids.values()))

    def kill_leftovers(self) -> None:
        """Kill what runs on the hosts besides their sshd masters (a hung launcher's daemons,
        ranks and sessions); the hosts stay up."""
        for _ in range(5):  # processes may fork while we kill
            left = self.leftovers()
            if not left:
                return
            _kill_all(left, grace=0.0)

    # ------------------------------------------------------------- internal

    def _acquire_lock(self) -> None:
        # flock is per open file, so a second instance in this process would
        # wait on itself: fail fast instead
        active = TestHosts._active_in_process
        if active is not None and active is not self:
            raise TestHostsError(
                f"{active!r} is still running in this process; only one set of "
                "test hosts can run at a time (stop it or share one fixture)"
            )
        fh = open(LOCK_PATH, "a+")  # noqa: SIM115 - held until stop()
        deadline = time.monotonic() + self.lock_timeout
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    fh.close()
                    raise
                fh.seek(0)
                if fh.read().strip() == str(os.getpid()):
                    fh.close()  # held by this process via another module copy
                    raise TestHostsError(
                        "test hosts are already running in this process; only one set "
                        "can run at a time (stop it or share one fixture)"
                    ) from exc
                if time.monotonic() > deadline:
                    fh.close()
                    raise TestHostsError(
                        f"test hosts busy: {LOCK_PATH} held by another run"
                    ) from exc
                time.sleep(0.2)
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._lock_fh = fh
        TestHosts._active_in_process = self

    def _release_lock(self) -> None:
        if TestHosts._active_in_process is self:
            TestHosts._active_in_process = None
        if self._lock_fh is not None:
            try:
                fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock_fh.close()
                self._lock_fh = None

    def _make_state_dir(self) -> None:
        if self._state_dir_arg is None:
            path = Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
        else:
            path = self._state_dir_arg
            path.mkdir(parents=True, exist_ok=True)
        # sshd (StrictModes no) and ssh need nothing special, but keep keys
        # private: ssh refuses an identity file readable by others.
        path.chmod(0o755)
        self._state_dir = path
        self._write_marker()

    def _write_marker(self) -> None:
        marker = {
            "mode": self.mode,
            "names": self.names,
            "addresses": self.addresses,
            "ports": self.ports,
            "pids": self.pids,
            "uts": self.uts,
            "uts_ns": self._uts_ns,
            "owner_pid": os.getpid(),
        }
        (self.state_dir / MARKER_NAME).write_text(json.dumps(marker, indent=1) + "\n")

    def _remove_state_dir(self) -> None:
        path = self._state_dir
        if path is None or not path.exists():
            return
        if (path / MARKER_NAME).exists() or not any(path.iterdir()):
            shutil.rmtree(path, ignore_errors=True)

    def _setup_network(self) -> None:
        """The bridge, then each host's namespace and veth pair (one ``ip -batch`` here),
        then each namespace's addresses (one ``ip -n NS -batch`` per host, a few at once)."""
        lines = [
            f"link add name {BRIDGE} type bridge",
            f"addr add {BRIDGE_ADDRESS}/{PREFIX_LEN} dev {BRIDGE}",
            f"link set dev {BRIDGE} up",
        ]
        for k, name in enumerate(self.names, start=1):
            ns, veth = netns_name(name), f"{VETH_PREFIX}{name}"
            lines += [
                f"netns add {ns}",
                f"link add name {veth} type veth peer name eth0 netns {ns}",
                f"link set dev {veth} master {BRIDGE} up",
            ]
            self.addresses[name] = f"{SUBNET}.{NODE_OFFSET + k}"
            self.ports[name] = 22
        _ip_batch(lines)

        def inside(name: str) -> None:
            address = self.addresses[name]
            _ip_batch(
                [
                    "link set dev lo up",
                    f"addr add {address}/{PREFIX_LEN} dev eth0",
                    "link set dev eth0 up",
                ],
                namespace=netns_name(name),
            )

        _each_host(inside, self.names)

    def _choose_loopback_addresses(self) -> None:
        root = _is_root()
        for k, name in enumerate(self.names, start=1):
            address = f"127.{LANE}.0.{k + 1}"  # (loopback is all of 127.0.0.0/8)
            self.addresses[name] = address
            self.ports[name] = 22 if root else _free_port(address)

    def _generate_keys(self) -> None:
        state = self.state_dir
        _run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "dtrain-testhosts-client",
                "-f",
                str(self.identity),
            ]
        )
        self.authorized_keys.write_text(self.identity.with_suffix(".pub").read_text())
        self.authorized_keys.chmod(0o644)

        def host_key(name: str) -> None:
            hdir = state / name
            hdir.mkdir(exist_ok=True)
            _run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-C",
                    f"{name}-hostkey",
                    "-f",
                    str(hdir / "ssh_host_ed25519_key"),
                ]
            )

        _each_host(host_key, self.names)

    def _write_client_files(self) -> None:
        known: list[str] = []
        config: list[str] = [
            "# generated by tests/testhosts.py; use: ssh -F THIS_FILE node1",
        ]
        user = "root" if _is_root() else _current_user()
        for name in self.names:
            address, port = self.addresses[name], self.ports[name]
            pub = (self.host_dir(name) / "ssh_host_ed25519_key.pub").read_text().split()
            keytext = f"{pub[0]} {pub[1]}"
            if port == 22:
                known.append(f"{name},{address} {keytext}")
            else:
                known.append(f"[{name}]:{port},[{address}]:{port} {keytext}")
            config += [
                "",
                f"Host {name} {address}",
                f"    HostName {address}",
                f"    Port {port}",
            ]
        config += [
            "",
            "Host *",
            f"    User {user}",
            f"    IdentityFile {self.identity}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {self.known_hosts}",
            "    GlobalKnownHostsFile /dev/null",
            "    StrictHostKeyChecking yes",
            "    HashKnownHosts no",
            "    UpdateHostKeys no",
            "    CheckHostIP no",
            "    BatchMode yes",
            "    PasswordAuthentication no",
            "    KbdInteractiveAuthentication no",
            "    ConnectTimeout 10",
            "    ServerAliveInterval 15",
            "    LogLevel ERROR",
            "",
        ]
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("\n".join(config))
        self.ssh_config.chmod(0o644)

    def _sshd_config(self, name: str) -> Path:
        hdir = self.host_dir(name)
        lines = [
            "# generated by tests/testhosts.py",
            f"ListenAddress {self.addresses[name]}:{self.ports[name]}",
            "AddressFamily inet",
            f"HostKey {hdir / 'ssh_host_ed25519_key'}",
            f"PidFile {hdir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "HostbasedAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitUserEnvironment no",
            "MaxStartups 100:30:200",
            "MaxSessions 100",
            "MaxAuthTries 6",
            "LoginGraceTime 30",
            "UseDNS no",
            "PrintMotd no",
            "PrintLastLog no",
            "X11Forwarding no",
            "AllowTcpForwarding yes",
            "LogLevel INFO",
        ]
        for sftp in SFTP_SERVER_CANDIDATES:
            if os.access(sftp, os.X_OK):
                lines.append(f"Subsystem sftp {sftp}")
                break
        path = hdir / SSHD_CONFIG_NAME
        path.write_text("\n".join(lines) + "\n")
        return path

    def _start_daemons(self) -> None:
        sshd = sshd_path()
        assert sshd is not None
        if _is_root():
            PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        unshare = shutil.which("unshare")
        self.uts = self.netns or (_is_root() and unshare is not None and _uts_works(unshare))
        configs = {name: self._sshd_config(name) for name in self.names}
        # The configs differ only in addresses and paths: checking one finds what sshd
        # rejects in them (64 checks took 0.6 s); a host that cannot start says so in its log
        # when _wait_ready finds its sshd gone.
        first = configs[self.names[0]]
        check = _run([sshd, "-t", "-f", str(first)], check=False)
        if check.returncode != 0:
            raise TestHostsError(f"sshd rejects {first}: {check.stderr.strip()}")
        for name in self.names:
            config = configs[name]
            daemon = [sshd, "-D", "-e", "-f", str(config)]
            argv: list[str] = []
            if self.netns:
                argv += ["ip", "netns", "exec", netns_name(name)]
            if self.uts:
                assert unshare is not None
                # exec chain keeps the Popen pid == sshd's pid
                argv += [
                    unshare,
                    "--uts",
                    "sh",
                    "-c",
                    f"hostname {shlex.quote(name)} && exec {shlex.join(daemon)}",
                ]
            else:
                argv += daemon
            with open(self.log_path(name), "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    close_fds=True,
                )
            self._procs[name] = proc
            self.pids[name] = proc.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        pending = list(self.names)
        while pending:
            for name in list(pending):
                proc = self._procs[name]
                if proc.poll() is not None:
                    raise TestHostsError(
                        f"sshd for {name} exited with {proc.returncode}:\n{self._log_tail(name)}"
                    )
                try:
                    with socket.create_connection(
                        (self.addresses[name], self.ports[name]), timeout=0.5
                    ) as sock:
                        sock.settimeout(2.0)
                        banner = sock.recv(64)
                    if banner.startswith(b"SSH-"):
                        pending.remove(name)
                except OSError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise TestHostsError(
                        f"sshd not accepting connections on {pending} after "
                        f"{self.start_timeout}s:\n" + "\n".join(self._log_tail(n) for n in pending)
                    )
                time.sleep(0.05)
        # record the daemon's own view of its pid (equal to Popen's pid)
        for name in self.names:
            pidfile = self.host_dir(name) / "sshd.pid"
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.pids[name] = int(pidfile.read_text().split()[0])
            if self.uts and not self.netns:
                ns_id = _ns_id(self.pids[name], "uts")
                if ns_id is not None and ns_id != _ns_id(os.getpid(), "uts"):
                    self._uts_ns[name] = ns_id

    def _log_tail(self, name: str, lines: int = 20) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return f"[{name}: no log]"
        return f"[{name} log]\n" + "\n".join(text.splitlines()[-lines:])

    def __repr__(self) -> str:
        where = self._state_dir or self._state_dir_arg
        return (
            f"TestHosts(count={self.count}, mode={self.mode!r}, "
            f"state_dir={str(where)!r}, started={self._started})"
        )


def _current_user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


_UTS_OK: bool | None = None


def _uts_works(unshare: str) -> bool:
    global _UTS_OK
    if _UTS_OK is None:
        proc = subprocess.run([unshare, "--uts", "true"], capture_output=True, check=False)
        _UTS_OK = proc.returncode == 0
    return _UTS_OK


if __name__ == "__main__":  # pragma: no cover - manual smoke test
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with TestHosts(n) as hosts:
        for host in hosts.names:
            print(host, hosts.run(host, "hostname").stdout.strip())
