"""What a host looks like from the inside: ``python -I -c PROBE_SOURCE JSON_ARGS``.

Stdlib only and self-contained (sent as text over SSH).  Prints one JSON
object: hostname, Python, working directory and program found or not, free
ports, GPUs (nvidia-smi), the CPUs it may use with their sockets, the clock,
with ``versions`` the installed versions of the frameworks dtrain launches, and
with ``gpu_details`` (``dtrain check``: more nvidia-smi queries, run at once) the
NVIDIA driver, its CUDA version, the GPUs' ECC errors and other processes on
them, and torch's CUDA build.
"""

from __future__ import annotations

import json
import os
import re
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


SMI_TIMEOUT_S = 10
GPU_QUERY = ["--query-gpu=index,name,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
# dtrain check only: each GPU's identity, driver, memory and uncorrected ECC errors since the
# driver loaded; the processes computing on them; the CUDA version the driver supports (in
# the header of ``-q``: no --query-gpu field names it on older drivers).
DEVICE_FIELDS = (
    "index", "name", "uuid", "driver_version", "memory.used", "memory.total",
    "ecc.errors.uncorrected.volatile.total",
)  # fmt: skip
APP_FIELDS = ("gpu_uuid", "pid", "used_memory", "process_name")  # the name last: it may hold ','
CUDA_VERSION = re.compile(r"CUDA Version\s*:\s*([0-9][0-9.]*)")


def find_nvidia_smi(path: str) -> str | None:
    import shutil  # (here: the launcher imports this module too: both cost its start)

    return shutil.which("nvidia-smi", path=path)


def gpus(smi: str | None) -> list[dict[str, str]]:
    if smi is None:
        return []
    _, out = run_all([[smi, *GPU_QUERY]])[0]
    return parse_gpus(out)  # (whatever the status: a lost GPU fails it, the others are listed)


def parse_gpus(out: str) -> list[dict[str, str]]:
    found = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4:
            found.append(dict(zip(("index", "name", "utilization", "memory_mib"), fields)))  # noqa: B905 (runs on old Pythons too)
    return found


def run_all(commands: list[list[str]]) -> list[tuple[int | None, str]]:
    """Each command's exit status and output, all started at once and bounded together by
    SMI_TIMEOUT_S (nvidia-smi can take seconds to wake a driver); None: it could not start,
    or ran out of time (the output says which)."""
    import subprocess

    running: list[subprocess.Popen[str] | str] = []
    for argv in commands:
        try:
            running.append(
                subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        except OSError as exc:
            running.append(str(exc))
    deadline = time.monotonic() + SMI_TIMEOUT_S
    results: list[tuple[int | None, str]] = []
    for process in running:
        if isinstance(process, str):
            results.append((None, process))
            continue
        try:
            out, err = process.communicate(timeout=max(deadline - time.monotonic(), 0.01))
            results.append((process.returncode, out if process.returncode == 0 else out + err))
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            results.append((None, f"no answer within {SMI_TIMEOUT_S} s"))
    return results


def gpus_in_detail(smi: str | None) -> tuple[list[dict[str, str]], dict[str, object]]:
    """``gpus()`` and, for ``dtrain check``, the GPU stack of this host: driver and the CUDA
    version it supports, each GPU's memory and ECC errors, the processes using them, and the
    CUDA version torch was built for; ``error``: why nvidia-smi did not answer."""
    details: dict[str, object] = {"torch": torch_build(), "devices": [], "apps": []}
    if smi is None:
        return [], details
    csv = "--format=csv,noheader,nounits"
    answers = run_all(
        [
            [smi, *GPU_QUERY],
            [smi, "--query-gpu=" + ",".join(DEVICE_FIELDS), csv],
            [smi, "--query-compute-apps=" + ",".join(APP_FIELDS), csv],
            [smi, "-q", "-d", "COMPUTE"],
        ]
    )
    failed = [out for status, out in answers if status != 0]
    if failed:
        details["error"] = (failed[0].strip().splitlines() or ["no output"])[0]
    (_, basic), (_, devices), (_, apps), (_, header) = answers
    details["devices"] = csv_rows(devices, DEVICE_FIELDS)
    details["apps"] = csv_rows(apps, APP_FIELDS)
    cuda = CUDA_VERSION.search(header)
    details["cuda"] = cuda.group(1) if cuda else None
    return parse_gpus(basic), details


def csv_rows(out: str, names: tuple[str, ...]) -> list[dict[str, str | None]]:
    """nvidia-smi's CSV lines as records; a value it does not report (``[N/A]``, ``[Not
    Supported]``, ``[Insufficient Permissions]``...) is None; a line that is not a record
    (an error) is left out."""
    rows = []
    for line in out.splitlines():
        values = [v.strip() for v in line.split(",", len(names) - 1)]
        if len(values) == len(names):
            known = [None if v in ("", "N/A") or v.startswith("[") else v for v in values]
            rows.append(dict(zip(names, known)))  # noqa: B905
    return rows


def torch_build() -> dict[str, str | None] | None:
    """torch's version and the CUDA version it was built for, read from its ``version.py``
    as text (importing torch would cost seconds); None where torch is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
            return parse_torch_version(f.read())
    except OSError:
        return None


def parse_torch_version(text: str) -> dict[str, str | None]:
    """``__version__ = '2.11.0+cu130'`` and ``cuda: Optional[str] = '13.0'`` (or ``= None``:
    a build without CUDA) of torch's ``version.py``."""
    found: dict[str, str | None] = {"version": None, "cuda": None}
    for line in text.splitlines():
        match = re.match(r"(__version__|cuda)\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\")", line)
        if match:
            key = "version" if match.group(1) == "__version__" else "cuda"
            found[key] = match.group(2) if match.group(2) is not None else match.group(3)
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
        "cpus": cpus(),
        "time": time.time(),
    }
    smi = find_nvidia_smi(path)  # as the ranks find it: with the launcher's PATH first
    if args.get("gpu_details"):
        report["gpus"], report["gpu_details"] = gpus_in_detail(smi)
    else:
        report["gpus"] = gpus(smi)
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
