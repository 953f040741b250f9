"""``launch()``'s and ``start()``'s keywords typed for editors and type checkers: dtrain
run's options but those the API sets, declared in ``core/options.py`` (tests/test_options.py
checks that these are its keywords, typed as their kinds)."""

import os
from collections.abc import Mapping, Sequence
from typing import Literal, TypedDict


class Options(TypedDict, total=False):
    nproc_per_node: str | int
    nnodes: str | int
    map_by: str
    oversubscribe: bool
    standalone: bool
    include: str
    exclude: str
    transport: Literal["auto", "ssh", "slurm"]
    gpus_per_rank: int
    no_gpu_binding: bool
    bind_to: Literal["none", "core", "socket"]
    report_bindings: bool
    env: str | Sequence[str] | Mapping[str, str | int | float]
    env_file: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
    workdir: str | os.PathLike[str]
    sync: str | os.PathLike[str]
    sync_max_size: int | str
    python: str | os.PathLike[str]
    master_addr: str
    master_port: int
    network_interface: str
    tf: bool
    mpi: bool
    mpirun: str | os.PathLike[str]
    mca: Mapping[str, str] | Sequence[tuple[str, str]]
    mpirun_args: str
    tag_format: str
    output_dir: str | os.PathLike[str]
    color: bool | None
    no_color: bool
    json: bool
    plain: bool
    quiet: bool
    ranks: str
    local_ranks: str
    collapse: bool | None
    no_collapse: bool
    collapse_window: float
    lossy_view: bool
    verbose: bool
    dry_run: bool
    job_dir: str | os.PathLike[str]
    config: str | os.PathLike[str]
    no_config: bool
    max_restarts: int
    restart_delay: float
    min_np: int
    max_np: int
    host_discovery_script: str | os.PathLike[str]
    blacklist_cooldown: float
    checkpoint_dir: str | os.PathLike[str]
    hang_timeout: float
    on_hang: Literal["fail", "dump"]
    start_timeout: float
    timeout: float
    grace: float
    progress_regex: str
    straggler_ratio: float
    straggler_after: float
    no_stragglers: bool
    ssh_config: str | os.PathLike[str]
    ssh_port: int
    ssh_identity: str | os.PathLike[str]
    ssh_timeout: float
    host_timeout: float
    accept_new_host_keys: bool
