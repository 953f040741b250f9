"""dtrain-netcheck: one host's part of ``dtrain check --network`` (``python -I -c SOURCE``).

Stdlib only and self-contained (sent as text over SSH).  The launcher and this program
talk in JSON lines, the launcher on its stdin, the program on its stdout:

- in: ``{"token", "probe_source", "route_to", "interface", "lifetime_s", "allreduce_source"}``
  (the token and everything else travel on stdin, never in argv); out: ``{"ready": {...}}``
  (the address and port it listens on) or ``{"error": ...}``.
- in: ``{"pings": [[NAME, address, port], ...]}``; out: ``{"pings": {NAME: {"rtt_ms"}}}``:
  the median of 20 one-byte round trips to each peer in turn (before any transfer).
- in: ``{"round": k, "send_to": [address, port], "name": NAME, "receive": bool, "bulk_s":
  S}``; out: ``{"round": k, "out": {...}, "in": {"bytes", "seconds"}}``: this host's transfer
  to its peer of the round, and what it received from another host meanwhile (counted by
  the receiver for about ``bulk_s``).
- in: ``{"prepare_allreduce": true}``: start the torch child (``netreduce.py``) if it has not
  started with the program (it does where CPUs are many, so that torch's import overlaps
  the measurements); out: ``{"allreduce": {...}}``, each line the child says; in:
  ``{"allreduce": {...}}``, the rendezvous, passed on to the child: one rank of a short
  allreduce.
- in: ``{"end": true}``, or the end of stdin (the launcher gone, its channel closed): the
  listener closes, the torch child is killed, the program exits.  So does it after
  ``lifetime_s`` whatever happens.

The listener binds an ephemeral port of the address the ranks would use (the interface
towards rank 0's host, as the host probe finds it, or ``interface``), and serves only a
connection whose first bytes are the token; any other is closed at once.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import subprocess
import sys
import threading
import time

HANDSHAKE_S = 2.0  # how long a connection may take to present the token, in all
# Connections not yet past the token, at once: more are closed unread, so that peers without
# it (anyone on the network can connect) cannot pile up threads; the check's own hosts open
# one or two each at a time.
UNAUTHENTICATED_MAX = 32
CONNECT_S = 2.0  # how long a send waits for its peer to accept
PINGS = 20  # round trips per pair; the median is the figure
CHUNK = 1 << 20  # bytes per send and per receive
MAX_BYTES = 256 << 20  # a pair's bulk transfer ends here even on a fast link
TAIL_S = 2.0  # past bulk_s, how long a transfer may last before it is cut
HEADER_LIMIT = 512  # bytes of the JSON line that follows the token
# CPUs from which torch's import (a core busy for seconds) may run beside the measurements
# (hiding its time) without taking a core they need; on fewer it waits until they are done
OVERLAP_CPUS = 4
SWITCH_S = 0.0005  # the GIL's: a thread woken by a reply does not wait out another's 5 ms


class Host:
    """This host's listener, the measurements it received, and its torch child."""

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.listener: socket.socket | None = None
        self.arrived: set[int] = set()  # rounds whose sender has presented the token
        self.received: dict[int, dict] = {}  # type: ignore[type-arg]  # round: measurement
        self.refused = 0  # connections without the token
        self.unauthenticated = threading.BoundedSemaphore(UNAUTHENTICATED_MAX)
        self.changed = threading.Condition()
        self.child: subprocess.Popen | None = None  # type: ignore[type-arg]
        self.child_source: str | None = None
        self.write_lock = threading.Lock()

    def say(self, message: dict) -> None:  # type: ignore[type-arg]
        with self.write_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def end(self, status: int = 0) -> None:
        """Close the listener, kill the child and leave, now (from any thread)."""
        if self.listener is not None:
            self.listener.close()
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
        try:
            sys.stdout.flush()
        finally:
            os._exit(status)

    def serve(self) -> None:
        """Accept connections until the program ends; each is handled in a thread."""
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            if not self.unauthenticated.acquire(blocking=False):
                conn.close()  # (too many without the token yet: no thread for this one)
                with self.changed:
                    self.refused += 1
                continue
            threading.Thread(target=self.take, args=(conn,), daemon=True).start()

    def take(self, conn: socket.socket) -> None:
        """One connection: the token, a header (round trips, or the transfer of a round)."""
        header: dict = {}  # type: ignore[type-arg]
        try:
            try:
                token = receive_by(conn, len(self.token), time.monotonic() + HANDSHAKE_S)
            except OSError:
                token = b""  # (closed, or silent, before a token's length of bytes)
            finally:
                self.unauthenticated.release()
            conn.settimeout(HANDSHAKE_S)
            if not hmac.compare_digest(token, self.token):
                with self.changed:
                    self.refused += 1
                return
            header = json.loads(receive_line(conn, HEADER_LIMIT))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if header.get("ping"):
                echo(conn)
                return
            if isinstance(header.get("round"), int):
                with self.changed:
                    self.arrived.add(header["round"])
                    self.changed.notify_all()
            figures = receive_bulk(conn, float(header["bulk_s"]))
            figures["from"] = header.get("from")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            figures = {"error": describe(exc)}
        finally:
            conn.close()  # (with unread data: a reset, which ends the sender's transfer)
        if isinstance(header, dict) and isinstance(header.get("round"), int):
            with self.changed:
                self.received[header["round"]] = figures
                self.changed.notify_all()

    def wait_received(self, round_k: int, started: float, bulk_s: float) -> dict:  # type: ignore[type-arg]
        """What arrived in round ``round_k``: its sender connects as the round starts (one
        lost is given up CONNECT_S after that), then sends for about ``bulk_s``."""
        with self.changed:
            deadline = started + CONNECT_S + HANDSHAKE_S
            for seen, missing in ((self.arrived, "no connection"), (self.received, "nothing")):
                while round_k not in seen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {"error": f"{missing} from its sender in time"}
                    self.changed.wait(left)
                deadline = time.monotonic() + bulk_s + TAIL_S
            return self.received[round_k]


def describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    return str(exc) or exc.__class__.__name__


def receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return data


def receive_by(conn: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes that must all arrive before ``deadline`` (a byte now and then does not
    keep a connection alive, as it would under a timeout per receive)."""
    data = b""
    while len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        conn.settimeout(left)
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the connection closed")
        data += chunk
    return data


def receive_line(conn: socket.socket, limit: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        if len(data) >= limit:
            raise ValueError("header too long")
        data += receive_exactly(conn, 1)
    return data


def echo(conn: socket.socket) -> None:
    """Send back each byte of the sender's round trips, until it closes."""
    while True:
        byte = conn.recv(1)
        if not byte:
            return
        conn.sendall(byte)


def receive_bulk(conn: socket.socket, bulk_s: float) -> dict:  # type: ignore[type-arg]
    """Count what arrives for ``bulk_s`` from the first byte (the receiver's clock and bytes:
    what sits in buffers when it stops does not count, nor does the first read)."""
    conn.settimeout(bulk_s + TAIL_S)
    buffer = bytearray(CHUNK)
    first = last = 0.0
    received = 0
    while True:
        count = conn.recv_into(buffer)
        now = time.monotonic()
        if not count:
            break
        if not first:
            first = now
        else:
            received += count
            last = now
        if now - first >= bulk_s:
            break
    return {"bytes": received, "seconds": max(last - first, 0.0)}


def open_to(address: str, port: int, token: bytes, header: dict) -> socket.socket:  # type: ignore[type-arg]
    conn = socket.create_connection((address, port), timeout=CONNECT_S)
    try:
        conn.settimeout(HANDSHAKE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(token + json.dumps(header).encode() + b"\n")
    except OSError:
        conn.close()
        raise
    return conn


def ping(address: str, port: int, token: bytes) -> dict:  # type: ignore[type-arg]
    """The median of PINGS round trips of one byte to the peer."""
    try:
        with open_to(address, port, token, {"ping": True}) as conn:
            trips = []
            for _ in range(PINGS):
                started = time.perf_counter()
                conn.sendall(b"p")
                receive_exactly(conn, 1)
                trips.append(time.perf_counter() - started)
    except OSError as exc:
        return {"error": f"{address}:{port}: {describe(exc)}"}
    trips.sort()
    return {"rtt_ms": round(trips[len(trips) // 2] * 1000, 3)}


def send_bulk(address: str, port: int, token: bytes, header: dict) -> dict:  # type: ignore[type-arg]
    """Bytes to the peer for as long as it reads them (it stops after ``bulk_s``)."""
    bulk_s = float(header["bulk_s"])
    try:
        conn = open_to(address, port, token, header)
    except OSError as exc:
        return {"error": f"cannot send to {address}:{port}: {describe(exc)}"}
    chunk = memoryview(bytes(CHUNK))
    sent, started = 0, time.monotonic()
    try:
        conn.settimeout(bulk_s + TAIL_S)
        while sent < MAX_BYTES and time.monotonic() - started < bulk_s + TAIL_S:
            conn.sendall(chunk)
            sent += CHUNK
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the receiver had enough and closed
    finally:
        conn.close()
    return {"sent": sent}


def interface_address(name: str) -> dict | None:  # type: ignore[type-arg]
    """``{"address", "interface"}`` of the IPv4 interface ``name`` (--network-interface)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None  # SIOCGIFADDR: no such interface, or no IPv4 address on it
    return {"address": socket.inet_ntoa(packed[20:24]), "interface": name}


def spare_port() -> int:
    """A free port for the allreduce's rendezvous (rank 0's host uses it; torch's store
    listens on every address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def open_listener(host: Host, config: dict) -> dict:  # type: ignore[type-arg]
    """Bind the ranks' interface; the ``ready`` report (or ``error``)."""
    if config.get("interface"):
        route = interface_address(config["interface"])
        if route is None:
            return {"error": f"no IPv4 address on interface {config['interface']!r} here"}
    else:
        namespace: dict = {"__name__": "dtrain_probe"}  # type: ignore[type-arg]
        exec(compile(config["probe_source"], "dtrain-probe", "exec"), namespace)
        route = namespace["interface_towards"](config["route_to"])
        if route is None:
            return {"error": f"no route towards {config['route_to']} here"}
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((route["address"], 0))
        listener.listen(64)
    except OSError as exc:
        listener.close()
        return {"error": f"cannot listen on {route['address']}: {describe(exc)}"}
    host.listener = listener
    ready = {
        "hostname": socket.gethostname(),
        "address": route["address"],
        "interface": route["interface"],
        "port": listener.getsockname()[1],
        "spare_port": spare_port(),
    }
    return {"ready": ready}


def start_child(host: Host, source: str) -> None:
    """The allreduce's rank (it imports torch at once and waits for the rendezvous); its
    lines go on to the launcher as ``{"allreduce": ...}``."""
    host.child = subprocess.Popen(
        [sys.executable, "-I", "-c", source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    errors: list[bytes] = []

    def keep_errors() -> None:
        assert host.child is not None and host.child.stderr is not None
        for line in host.child.stderr:
            errors[:] = [*errors[-4:], line]

    def relay() -> None:
        assert host.child is not None and host.child.stdout is not None
        for line in host.child.stdout:
            try:
                host.say({"allreduce": json.loads(line)})
            except ValueError:
                continue
        if host.child.wait() != 0:
            last = errors[-1].decode("utf-8", "replace").strip() if errors else "no output"
            host.say({"allreduce": {"error": f"exit status {host.child.returncode}: {last}"}})

    threading.Thread(target=keep_errors, daemon=True).start()
    threading.Thread(target=relay, daemon=True).start()


def run_round(host: Host, order: dict) -> None:  # type: ignore[type-arg]
    """A transfer to this round's peer while another host's arrives."""
    round_k = int(order["round"])
    bulk_s = float(order["bulk_s"])
    started = time.monotonic()
    out = None
    if order.get("send_to"):
        address, port = order["send_to"]
        header = {"round": round_k, "from": order.get("name"), "bulk_s": bulk_s}
        out = send_bulk(address, int(port), host.token, header)
    received = host.wait_received(round_k, started, bulk_s) if order.get("receive") else None
    host.say({"round": round_k, "out": out, "in": received})


def run_pings(host: Host, order: dict) -> None:  # type: ignore[type-arg]
    """Round trips to each peer in turn, before any transfer (which would delay them)."""
    found = {name: ping(address, int(port), host.token) for name, address, port in order["pings"]}
    host.say({"pings": found})


def follow_orders(host: Host) -> None:
    """The launcher's lines after the first, each done in a thread of its own so that the
    end of stdin (the launcher gone, or its channel closed) ends the program at once."""
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("end"):
            break
        if "round" in order or "pings" in order:
            work = run_round if "round" in order else run_pings
            threading.Thread(target=work, args=(host, order), daemon=True).start()
        elif "prepare_allreduce" in order and host.child is None and host.child_source:
            start_child(host, host.child_source)
        elif "allreduce" in order and host.child is not None and host.child.stdin is not None:
            host.child.stdin.write((json.dumps(order["allreduce"]) + "\n").encode())
            host.child.stdin.flush()
    with host.changed:
        host.say({"refused": host.refused})
    host.end(0)


def usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # (Linux: the CPUs this process may run on)
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main() -> None:
    config = json.loads(sys.stdin.readline() or "{}")
    host = Host(str(config.get("token", "")).encode())
    sys.setswitchinterval(SWITCH_S)
    if not host.token:
        host.say({"error": "no token given"})
        host.end(2)
    lifetime = threading.Timer(float(config.get("lifetime_s", 60)), host.end, [3])
    lifetime.daemon = True
    lifetime.start()
    ready = open_listener(host, config)
    host.say(ready)
    if "error" in ready:
        host.end(1)
    try:
        threading.Thread(target=host.serve, daemon=True).start()
        host.child_source = config.get("allreduce_source")
        if host.child_source and usable_cpus() >= OVERLAP_CPUS:
            start_child(host, host.child_source)
        follow_orders(host)
    finally:
        host.end(1)  # (a bad line from the launcher: no listener or child outlives it)


if __name__ == "__main__":
    main()
