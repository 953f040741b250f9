"""Other launchers' spellings of dtrain's options (pure): mpirun, torchrun, horovodrun and
deepspeed flags, the options table's peers (``core/options.py`` declares dtrain's own).

Users arrive with habits: ``-n 4 -hostfile hosts`` (mpirun), ``--nproc_per_node=2
--nnodes 2`` (torchrun), ``-p 2222 --start-timeout 60`` (horovodrun),
``--include h1@h3 --num_gpus 2`` (deepspeed).  Each peer flag here is one of:

* an alias: it sets the same config field as dtrain's own flag (hidden from
  ``--help``, listed in docs/coming-from.md); given together with dtrain's own
  spelling and a different value, it is an error, never a silent choice;
* accepted: a flag whose purpose dtrain always serves (``--tag-output``,
  torchrun's ``--rdzv-backend``), taken and ignored;
* refused: a flag dtrain has no equivalent for, answered with one line naming
  the peer and what to do instead.

``PEER_FLAGS`` is the single table: ``cli/dialects.py`` makes hidden click options of it,
the tests run every row, and docs/coming-from.md must list every flag in it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from launcher.base.errors import UsageError

Kind = Literal["flag", "int", "float", "text", "list"]  # a float is a duration (finite seconds)


@dataclass(frozen=True)
class PeerFlag:
    """Another launcher's option, and what dtrain makes of it."""

    peer: str  # mpirun, torchrun, horovodrun, deepspeed (or several, "torchrun/deepspeed")
    flags: str  # its spellings, space-separated
    field: str | None  # the config field it sets; None: accepted and ignored, or refused
    dtrain: str  # dtrain's own spelling, or what dtrain does instead
    kind: Kind = "flag"
    value: Any = None  # for a flag: the value it sets (e.g. --bind_cores_to_rank: "core")
    refused: str | None = None  # why not, and what to do instead
    example: str | None = None  # a value, for the tests and the docs
    same: str | None = None  # dtrain's arguments meaning the same (default: dtrain + example)
    context: str = ""  # arguments both spellings need around them in the tests (e.g. --mpi)

    @property
    def equivalent(self) -> list[str]:
        """dtrain's own arguments for this flag with its example value (what the tests run)."""
        if self.same is not None:
            return self.same.split()
        return [*self.dtrain.split(), *([self.example] if self.example else [])]


def alias(
    peer: str, flags: str, field: str, dtrain: str, kind: Kind = "flag", **kw: Any
) -> PeerFlag:
    return PeerFlag(peer, flags, field, dtrain, kind, **kw)


def accept(peer: str, flags: str, dtrain: str, kind: Kind = "flag", **kw: Any) -> PeerFlag:
    return PeerFlag(peer, flags, None, dtrain, kind, **kw)


def refuse(peer: str, flags: str, instead: str) -> PeerFlag:
    return PeerFlag(peer, flags, None, "-", refused=instead)


TIMESTAMP_TAG = "{time} [{rank}]"  # --timestamp-output: the time each line was written
ELASTIC = "dtrain restarts whole jobs: --max-restarts with --min-np/--max-np (fault-tolerance.md)"
HOROVOD_KNOB = (
    "a Horovod runtime setting: pass its HOROVOD_ variable, e.g. -x HOROVOD_TIMELINE=FILE"
)
PEER_FLAGS: tuple[PeerFlag, ...] = (
    # mpirun (Open MPI)
    alias("mpirun", "-n -c", "np", "-np", "int", example="2"),
    alias(
        "mpirun",
        "-N -npernode --npernode",
        "nproc_per_node",
        "--nproc-per-node",
        "text",
        example="2",
    ),
    alias("mpirun", "-host", "host_lists", "-H", "list", example="localhost:2"),
    alias(
        "mpirun",
        "-hostfile -machinefile --machinefile",
        "hostfile",
        "--hostfile",
        "text",
        example="HOSTFILE",
    ),
    alias("mpirun", "-wdir --wdir -wd --wd", "workdir", "--workdir", "text", example="."),
    alias(
        "mpirun",
        "--output-filename -output-filename",
        "output_dir",
        "--output-dir",
        "text",
        example="OUTDIR",
    ),
    alias("mpirun", "--display-map -display-map", "report_bindings", "--report-bindings"),
    alias("mpirun", "--do-not-launch", "dry_run", "--dry-run"),
    accept("mpirun", "--tag-output -tag-output", "always: every line is tagged with its rank"),
    alias(
        "mpirun",
        "--timestamp-output -timestamp-output",
        "tag_format",
        "--tag-format",
        value=TIMESTAMP_TAG,
        example=TIMESTAMP_TAG,
    ),
    accept("mpirun", "--allow-run-as-root", "not needed: dtrain passes it to mpirun under --mpi"),
    refuse(
        "mpirun",
        "--rankfile -rf",
        "place ranks with a hostfile's slots, --map-by and --nproc-per-node",
    ),
    refuse(
        "mpirun",
        "--preload-binary -s --preload-files",
        "copy the code to every host with --sync DIR, or put it at the same path there",
    ),
    refuse("mpirun", "--stdin", "ranks read no terminal input; pass data in files or arguments"),
    refuse(
        "mpirun",
        "--merge-stderr-to-stdout",
        "dtrain keeps both streams apart and shows both; use --json for one stream",
    ),
    refuse(
        "mpirun",
        "--prefix",
        "dtrain runs the same interpreter path on every host; set PATH with -x PATH=...",
    ),
    refuse(
        "mpirun",
        "--rank-by --cpus-per-proc --cpus-per-rank --use-hwthread-cpus",
        "use --bind-to core (each rank its share of the cores) or socket",
    ),
    refuse("mpirun", "--app --xml --tune", "write the dtrain command line instead"),
    # torchrun
    alias(
        "torchrun", "--nproc_per_node", "nproc_per_node", "--nproc-per-node", "text", example="2"
    ),
    alias("torchrun", "--master_addr", "master_addr", "--master-addr", "text", example="127.0.0.1"),
    alias("torchrun", "--master_port", "master_port", "--master-port", "int", example="29555"),
    alias(
        "torchrun",
        "--rdzv-endpoint --rdzv_endpoint",
        "rdzv_endpoint",
        "--master-addr/--master-port",
        "text",
        example="127.0.0.1:29556",
        same="--master-addr 127.0.0.1 --master-port 29556",
    ),
    alias("torchrun", "--no_python", "no_python", "--no-python"),
    alias(
        "torchrun", "--log-dir --log_dir", "output_dir", "--output-dir", "text", example="OUTDIR"
    ),
    alias(
        "torchrun",
        "--local-ranks-filter --local_ranks_filter",
        "local_ranks",
        "--local-ranks",
        "text",
        example="0",
    ),
    alias(
        "torchrun",
        "-r --redirects",
        "redirects",
        "--quiet (3), or that stream off the terminal (1: stdout, 2: stderr)",
        "text",
        example="3",
        same="--quiet",
    ),
    accept(
        "torchrun",
        "-t --tee",
        "always: the job directory keeps every rank's output (--output-dir: also DIR)",
        "text",
        example="3",
    ),
    accept(
        "torchrun",
        "--rdzv-backend --rdzv_backend --rdzv-id --rdzv_id",
        "dtrain's rendezvous (MASTER_ADDR/MASTER_PORT, the job id)",
        "text",
        example="c10d",
    ),
    accept(
        "torchrun",
        "--monitor-interval --monitor_interval",
        "ranks are watched by events, not polled",
        "text",
        example="5",
    ),
    accept(
        "torchrun",
        "--start-method --start_method",
        "ranks are always fresh processes",
        "text",
        example="spawn",
    ),
    refuse(
        "torchrun",
        "--node-rank --node_rank",
        "dtrain starts every host from this one command; node ranks follow the host order",
    ),
    alias("torchrun", "--max_restarts", "max_restarts", "--max-restarts", "int", example="2"),
    refuse(
        "torchrun",
        "--role",
        "every rank's ROLE_NAME is 'default'; dtrain ps gives roles (chief, worker, ps)",
    ),
    refuse(
        "torchrun",
        "--rdzv-conf --rdzv_conf --local-addr --local_addr --logs-specs --logs_specs "
        "--run-path --run_path",
        "dtrain finds addresses itself; run the script as COMMAND",
    ),
    # horovodrun
    alias("horovodrun", "--num-proc", "np", "-np", "int", example="2"),
    alias("horovodrun", "--hosts", "host_lists", "-H", "list", example="localhost:2"),
    alias("horovodrun", "-p", "port", "--ssh-port", "int", example="22"),
    alias("horovodrun", "--ssh-identity-file", "identity", "--ssh-identity", "text", example="KEY"),
    alias(
        "horovodrun",
        "--network-interfaces --nics",
        "nics",
        "--network-interface",
        "text",
        example="lo",
    ),
    accept("horovodrun", "--gloo", "the default (without --mpi)"),
    accept("horovodrun", "--disable-cache", "dtrain keeps no cache of host checks"),
    alias(
        "horovodrun",
        "--mpi-args",
        "mpirun_args",
        "--mpirun-args",
        "text",
        example="-v",
        context="--mpi",
    ),
    refuse(
        "horovodrun",
        "--check-build",
        "dtrain check -H HOSTS shows Python and the frameworks on every host",
    ),
    refuse(
        "horovodrun",
        "--slots-per-host --slots",
        "the discovery script gives each host's slots (host:slots lines)",
    ),
    refuse(
        "horovodrun", "--blacklist-cooldown-range", "give one time: --blacklist-cooldown SECONDS"
    ),
    refuse(
        "horovodrun",
        "--elastic-timeout --reset-limit",
        "restarts are counted by --max-restarts; hosts are waited for by --ssh-timeout",
    ),
    refuse(
        "horovodrun",
        "--timeline-filename --timeline-mark-cycles --autotune --autotune-log-file "
        "--fusion-threshold-mb --cycle-time-ms --cache-capacity --hierarchical-allreduce "
        "--hierarchical-allgather --log-level",
        HOROVOD_KNOB,
    ),
    refuse(
        "horovodrun",
        "--gloo-timeout-seconds",
        "Gloo's timeout in Horovod is its variable: -x HOROVOD_GLOO_TIMEOUT_SECONDS=60",
    ),
    # deepspeed
    alias(
        "deepspeed",
        "--num_gpus --num-gpus",
        "nproc_per_node",
        "--nproc-per-node",
        "text",
        example="2",
    ),
    alias("deepspeed", "--num_nodes --num-nodes", "nnodes", "--nnodes", "text", example="1"),
    alias("deepspeed", "-e", "exclude", "--exclude", "text", example="nohost"),
    alias(
        "deepspeed",
        "--enable_each_rank_log",
        "output_dir",
        "--output-dir",
        "text",
        example="OUTDIR",
    ),
    alias("deepspeed", "--bind_cores_to_rank", "bind_to", "--bind-to core", value="core"),
    alias("deepspeed", "--ssh_port", "port", "--ssh-port", "int", example="22"),
    alias(
        "deepspeed",
        "--launcher",
        "launcher",
        "--mpi for openmpi; pdsh/ssh: the default",
        "text",
        example="openmpi",
        same="--mpi",
    ),
    accept(
        "deepspeed",
        "--no_local_rank --no-local-rank",
        "dtrain never passes --local_rank; ranks read LOCAL_RANK",
    ),
    accept("deepspeed", "--force_multi --force-multi", "hosts are used as listed, one or many"),
    refuse(
        "deepspeed",
        "--autotuning --elastic_training --min_elastic_nodes --max_elastic_nodes",
        ELASTIC,
    ),
    refuse(
        "deepspeed",
        "--bind_core_list --bind-core-list",
        "use --bind-to core (each rank its share of the cores)",
    ),
    refuse(
        "deepspeed",
        "--venv_script",
        "dtrain passes VIRTUAL_ENV and runs the same interpreter path on every host",
    ),
    refuse("deepspeed", "--save_pid", "dtrain jobs --running lists the job; dtrain stop stops it"),
    alias(
        "deepspeed",
        "--launcher_args",
        "mpirun_args",
        "--mpirun-args",
        "text",
        example="-v",
        context="--mpi",
    ),
    # one letter, two meanings
    refuse(
        "horovodrun/deepspeed",
        "-i",
        "ambiguous: horovodrun's -i is --ssh-identity, deepspeed's -i is --include; spell it out",
    ),
)


def merge_peer_values(
    options: Mapping[str, Any],
    peers: Mapping[str, tuple[str, Any]],
    defaults: Mapping[str, Any],
    own_flags: Mapping[str, str],
) -> dict[str, Any]:
    """dtrain's options with the peer spellings' values in; both given and different: error."""
    merged = dict(options)
    for field, (flag, value) in peers.items():
        own = merged.get(field, defaults.get(field))
        if isinstance(own, tuple):  # repeatable (-H): both add up
            merged[field] = own + tuple(value)
            continue
        if own not in (None, False) and own != defaults.get(field) and own != value:
            raise UsageError(
                f"{flag} {value} and {own_flags.get(field, field)} {own} both given",
                "give one of them",
            )
        merged[field] = value
    return merged
