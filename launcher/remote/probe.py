"""What a host looks like from the inside: ``python -I -c PROBE_SOURCE JSON_ARGS``.

Stdlib only and self-contained (sent as text over SSH).  Prints one JSON
object: hostname, Python, working directory and program found or not, free
ports, GPUs (nvidia-smi), the CPUs it may use with their sockets, the clock,
and with ``versions`` the installed versions of the frameworks dtrain launches.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

PACKAGES = {
    "dtrain": ("dtrain",),
    "torch": ("torch",),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-gpu"),
    "mpi4py": ("mpi4py",),
}


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def port_refusal(port: int) -> str | None:
    """Why a server could not listen on ``port`` here, tried as torch's TCPStore binds it
    (every address, IPv6 and IPv4, with SO_REUSEADDR: a port whose last connections wait
    in TIME_WAIT is free); None when it can."""
    import errno

    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
                s.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "in use"
                if exc.errno == errno.EACCES:
                    return "permission denied"
    return None


def cpus() -> list[list[int]]:
    """[cpu, socket] of every CPU this process may run on (its affinity: cgroups, taskset)."""
    found = []
    for cpu in sorted(os.sched_getaffinity(0)):
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id"
        try:
            with open(path) as f:
                package = int(f.read().strip())
        except (OSError, ValueError):
            package = 0
        found.append([cpu, max(package, 0)])
    return found


def gpus() -> list[dict[str, str]]:
    import shutil  # (here: the launcher imports this module too: both cost its start)
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [
                smi,
                "--query-gpu=index,name,utilization.gpu,memory.used",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4:
            found.append(dict(zip(("index", "name", "utilization", "memory_mib"), fields)))  # noqa: B905 (runs on old Pythons too)
    return found


def interface_towards(address: str) -> dict[str, str] | None:
    """The local address and network interface this host uses to reach ``address`` (IPv4)."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP: picks a route, sends nothing
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(
                        s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                    )
                except OSError:
                    continue  # SIOCGIFADDR: no IPv4 address on it
                if socket.inet_ntoa(packed[20:24]) == local:
                    mask = fcntl.ioctl(s.fileno(), 0x891B, struct.pack("256s", name[:15].encode()))
                    bits = bin(int.from_bytes(mask[20:24], "big")).count("1")
                    net = int.from_bytes(socket.inet_aton(local), "big") & (~0 << (32 - bits))
                    network = socket.inet_ntoa((net & 0xFFFFFFFF).to_bytes(4, "big"))
                    return {"address": local, "interface": name, "network": f"{network}/{bits}"}
    except OSError:
        return None
    return None


def versions() -> dict[str, str | None]:
    from importlib import metadata

    result: dict[str, str | None] = {}
    for name, distributions in PACKAGES.items():
        result[name] = None
        for dist in distributions:
            try:
                result[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return result


def find_program(program: str, cwd: str, path: str) -> str | None:
    if "/" in program:
        target = os.path.join(cwd, program)
        return target if os.path.exists(target) else None
    import shutil

    return shutil.which(program, path=path)


def probe(args: dict) -> dict:  # type: ignore[type-arg]
    cwd = args.get("cwd") or os.getcwd()
    path = (args.get("path_prefix") or "") + os.pathsep + os.environ.get("PATH", "")
    report = {
        "hostname": socket.gethostname(),
        "python": sys.executable,
        "python_version": ".".join(map(str, sys.version_info[:3])),
        "cwd": cwd,
        "cwd_ok": os.path.isdir(cwd),
        "ports": free_ports(int(args.get("ports", 1))),
        "gpus": gpus(),
        "cpus": cpus(),
        "time": time.time(),
    }
    if args.get("program"):
        report["program"] = find_program(args["program"], cwd, path)
    if args.get("script"):  # python SCRIPT: the script, beside the interpreter found above
        report["script"] = find_program(args["script"], cwd, path)
    if args.get("master_port"):
        report["master_port_refusal"] = port_refusal(int(args["master_port"]))
    if args.get("route_to"):
        report["route"] = interface_towards(args["route_to"])
    if args.get("versions"):
        report["versions"] = versions()
    return report


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})))
