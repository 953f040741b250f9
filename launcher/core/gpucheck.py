"""The GPU stack of ``dtrain check``'s hosts (pure): each host's probe turned into report
fields, and what would break a job across them.

A multi-host job needs the same NVIDIA driver and the same torch build everywhere (NCCL
and torch.distributed fail, or hang, between mismatched ones), a torch built for a CUDA
version the driver supports, GPUs no other process holds, and GPUs without uncorrected
memory errors.  ``judge_gpu_stacks`` names what is wrong as findings, each a line that
names its hosts; those that ``fail`` make the check exit 1, the others are warnings.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NCCL_MAY_FAIL = "NCCL across them may fail"
TORCH_MAY_FAIL = "torch.distributed across them may fail"


@dataclass(frozen=True)
class Finding:
    """One line of ``dtrain check``'s verdict: what is wrong, on which hosts."""

    hosts: tuple[str, ...]
    message: str
    fails: bool  # exit 1; else a warning


def gpu_fields(details: Mapping[str, Any] | None) -> dict[str, Any]:
    """One host's report fields from its probe's ``gpu_details`` (None: not asked): the
    driver and the CUDA version it supports, torch's CUDA build, the processes on its GPUs,
    uncorrected ECC errors per GPU where reported, and why nvidia-smi did not answer."""
    details = details or {}
    devices: list[Mapping[str, Any]] = details.get("devices") or []
    drivers = sorted({d["driver_version"] for d in devices if d.get("driver_version")})
    index_of = {d["uuid"]: d["index"] for d in devices if d.get("uuid")}
    torch = details.get("torch") or {}
    return {
        "driver": ", ".join(drivers) or None,  # (one per host: a host's GPUs share it)
        "driver_cuda": details.get("cuda"),
        "torch_cuda": torch.get("cuda"),
        "gpus_in_use": [
            {
                "gpu": index_of.get(app.get("gpu_uuid"), app.get("gpu_uuid")),
                "pid": as_int(app.get("pid")),
                "process": app.get("process_name"),
                "memory_mib": as_int(app.get("used_memory")),
            }
            for app in details.get("apps") or []
        ],
        "ecc_uncorrected": {
            d["index"]: count
            for d in devices
            if (count := as_int(d.get("ecc.errors.uncorrected.volatile.total"))) is not None
        },
        "nvidia_smi_error": details.get("error"),
    }


def as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def judge_gpu_stacks(rows: Sequence[Mapping[str, Any]]) -> list[Finding]:
    """What is wrong with the GPU stacks of the hosts that answered (rows with ``gpu_fields``):
    versions that differ from the other hosts', then each host's own problems."""
    answered = [row for row in rows if row.get("ok") and "driver" in row]
    findings: list[Finding] = []
    for has, what, value_of, consequence in COMPARED:
        values = {row["host"]: value_of(row) for row in answered}
        known = {host: value for host, value in values.items() if value}
        findings.extend(differing((has, what), known, consequence))
    for row in answered:
        findings.extend(host_findings(row))
    return findings


def driver_of(row: Mapping[str, Any]) -> str | None:
    """The driver with the CUDA version it supports (the second follows from the first)."""
    if not row.get("driver"):
        return None
    return f"{row['driver']} (CUDA {row.get('driver_cuda') or '?'})"


def torch_of(row: Mapping[str, Any]) -> str | None:
    version = (row.get("versions") or {}).get("torch")
    return version.split("+")[0] if version else None  # (+cu130: the build, compared next)


def torch_build_of(row: Mapping[str, Any]) -> str | None:
    if not (row.get("versions") or {}).get("torch"):
        return None
    return f"CUDA {row['torch_cuda']}" if row.get("torch_cuda") else "CPU only"


# (what a host "has", what differs between hosts, the value of a row, what may break)
COMPARED: tuple[tuple[str, str, Callable[[Mapping[str, Any]], str | None], str], ...] = (
    ("NVIDIA driver", "NVIDIA driver", driver_of, NCCL_MAY_FAIL),
    ("torch", "torch version", torch_of, TORCH_MAY_FAIL),
    ("torch built for", "torch's CUDA build", torch_build_of, TORCH_MAY_FAIL),
)


def differing(named: tuple[str, str], values: Mapping[str, str], consequence: str) -> list[Finding]:
    """The hosts whose value differs from most hosts', one finding each; with no value held
    by more hosts than any other, one finding that names every host by its value.
    ``named``: what a host has (``NVIDIA driver``), what differs (``NVIDIA driver``)."""
    has, what = named
    counts = Counter(values.values()).most_common()
    if len(counts) < 2:
        return []
    (most, most_count), (_, next_count) = counts[0], counts[1]
    if most_count == next_count:
        groups = sorted({v: [h for h in values if values[h] == v] for v in values.values()}.items())
        listed = "; ".join(f"{value} on {', '.join(hosts)}" for value, hosts in groups)
        return [Finding(tuple(values), f"hosts differ in {what} ({listed}): {consequence}", True)]
    odd = [host for host, value in values.items() if value != most]
    others = "the other hosts have" if len(odd) == 1 else "most hosts have"
    return [
        Finding(
            (host,), f"{host} has {has} {values[host]} where {others} {most}; {consequence}", True
        )
        for host in odd
    ]


def host_findings(row: Mapping[str, Any]) -> list[Finding]:
    """One host's own problems: torch built for a newer CUDA than its driver supports,
    uncorrected ECC errors (both fail), GPUs other processes use, nvidia-smi failing."""
    host = row["host"]
    found: list[Finding] = []
    too_new = torch_too_new(row.get("torch_cuda"), row.get("driver_cuda"))
    if too_new is not None and (row.get("versions") or {}).get("torch"):
        found.append(Finding((host,), f"{host}: {too_new[0]}", too_new[1]))
    errors = {gpu: n for gpu, n in (row.get("ecc_uncorrected") or {}).items() if n > 0}
    if errors:
        listed = ", ".join(f"GPU {gpu} has {n}" for gpu, n in errors.items())
        them = "it" if len(errors) == 1 else "them"
        gpus = ",".join(errors)
        found.append(
            Finding(
                (host,),
                f"{host}: {listed} uncorrected ECC errors; a job on {them} may crash or "
                f"compute wrong results (hint: reset {them}, or --exclude {host}:{gpus})",
                True,
            )
        )
    in_use = row.get("gpus_in_use") or []
    if in_use:
        listed = ", ".join(describe_process(p) for p in in_use)
        used = sorted({str(p["gpu"]) for p in in_use})
        them = "it" if len(used) == 1 else "them"
        found.append(
            Finding(
                (host,),
                f"{host}: {listed}; ranks bound there share {them} (hint: --exclude "
                f"{host}:{','.join(used)} leaves {them} out)",
                False,
            )
        )
    if row.get("nvidia_smi_error"):
        found.append(
            Finding((host,), f"{host}: nvidia-smi failed: {row['nvidia_smi_error']}", False)
        )
    return found


def describe_process(process: Mapping[str, Any]) -> str:
    """``GPU 0 in use by pid 4242 python3 (1200 MiB)`` (the program's name without its
    folder: nvidia-smi gives a path)."""
    pid = process["pid"] if process.get("pid") is not None else "?"
    name = f" {process['process'].rsplit('/', 1)[-1]}" if process.get("process") else ""
    memory = f" ({process['memory_mib']} MiB)" if process.get("memory_mib") is not None else ""
    return f"GPU {process['gpu']} in use by pid {pid}{name}{memory}"


def torch_too_new(torch_cuda: str | None, driver_cuda: str | None) -> tuple[str, bool] | None:
    """Why torch built for CUDA ``torch_cuda`` cannot (True) or may not (False) use a driver
    that supports CUDA up to ``driver_cuda``; None when it can, or either is unknown.  Within
    one major version CUDA's minor version compatibility runs it, except code compiled at
    run time (PTX); across major versions the driver refuses it."""
    torch_version, driver_version = version_tuple(torch_cuda), version_tuple(driver_cuda)
    if not torch_version or not driver_version or torch_version <= driver_version:
        return None
    said = f"torch is built for CUDA {torch_cuda} but the NVIDIA driver supports CUDA {driver_cuda}"
    if torch_version[0] > driver_version[0]:
        return (
            f"{said}; torch cannot use the GPUs there (hint: a torch build for CUDA "
            f"{driver_version[0]}, or a newer driver)",
            True,
        )
    return (
        f"{said}; it runs through CUDA's minor version compatibility, but kernels "
        "compiled at run time (PTX) fail",
        False,
    )


def version_tuple(version: str | None) -> tuple[int, ...]:
    """``12.4`` -> (12, 4); () where it is not a version."""
    try:
        return tuple(int(part) for part in (version or "").split("."))
    except ValueError:
        return ()


def with_findings(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``dtrain check`` with each answering host's ``problems`` and ``warnings``
    (the findings that name it); a host with a problem is no longer ``ok``."""
    findings = judge_gpu_stacks(rows)
    judged: list[dict[str, Any]] = []
    for row in rows:
        if not row.get("ok"):
            judged.append(dict(row))
            continue
        mine = [f for f in findings if row["host"] in f.hosts]
        problems = [f.message for f in mine if f.fails]
        warnings = [f.message for f in mine if not f.fails]
        judged.append({**row, "ok": not problems, "problems": problems, "warnings": warnings})
    return judged
