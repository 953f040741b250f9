"""``launcher.launch`` from a real Jupyter kernel: a notebook (run by nbclient) defines a
function in a cell and launches it on 4 local ranks, then on 2 SSH test hosts; every rank's
value and tagged line shows in the cell; a failing rank raises with its traceback; an
interrupt sent to the kernel tears the job down and leaves no process; a second launch in
the same kernel works.  ``examples/notebook_ddp.ipynb`` runs as written."""

from __future__ import annotations

import atexit
import queue
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import JOBS, MARK, REPO, child_env, wait_until_gone
from tests.testhosts import TestHosts

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupyter_client = pytest.importorskip("jupyter_client")

pytestmark = pytest.mark.timeout(240)

DEFINE = """\
import os, socket
from launcher import launch, RankFailed

def train(scale):
    rank = int(os.environ["RANK"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} training")
    print("epoch 1 done")
    return {"rank": rank, "value": rank * scale, "host": socket.gethostname()}
"""
FAIL = """\
def diverge():
    if os.environ["RANK"] == "1":
        raise FloatingPointError("loss is nan")
    import time; time.sleep(60)

launch(diverge, np=2, job_dir=JOB_DIR, env=MARKED)
"""


def run_notebook(cells: list[str], tags: dict[int, list[str]] | None = None) -> Any:
    """The notebook of these cells, executed in a fresh kernel (nbclient); returns it."""
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    for index, cell_tags in (tags or {}).items():
        notebook.cells[index].metadata["tags"] = cell_tags
    execute(notebook, child_env())
    return notebook


def execute(notebook: Any, env: dict[str, str]) -> None:
    """Run every cell in a fresh kernel started with ``env``, then shut the kernel down."""
    client = nbclient.NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    try:
        client.execute(env=env)
    finally:  # nbclient leaves an exit hook for a kernel it already shut down: it would fail
        atexit.unregister(client._cleanup_kernel)


def stream(cell: Any, name: str = "stdout") -> str:
    return "".join(o["text"] for o in cell.outputs if o.get("name") == name)


def setup_cell(mark: str, **extra: str) -> str:
    lines = [f"JOB_DIR = {str(JOBS)!r}", f"MARKED = {{{MARK!r}: {mark!r}}}"]
    lines += [f"{name} = {value!r}" for name, value in extra.items()]
    return "\n".join(lines)


def check_local_cell(cell: Any) -> None:
    """4 local ranks: every value, every tagged line (collapsed where all said it)."""
    out = stream(cell).splitlines()
    assert sorted(line for line in out if "training" in line) == [
        f"[{rank}] rank {rank} of 4 training" for rank in range(4)
    ]
    assert "[0-3] epoch 1 done" in out
    assert "values [0, 10, 20, 30]" in out
    assert not any("\x1e" in line or "\x1b" in line for line in out)  # no frames, no cursor


def test_a_notebook_cell_launches_its_function_on_4_ranks(mark: str) -> None:
    notebook = run_notebook(
        [
            setup_cell(mark),
            DEFINE,
            "result = launch(train, (10,), np=4, job_dir=JOB_DIR, env=MARKED)\n"
            "print('values', [v['value'] for v in result.values])",
            FAIL,
            "again = launch(train, (1,), np=2, job_dir=JOB_DIR, env=MARKED)\n"
            "print('again', [v['value'] for v in again.values])",
        ],
        tags={3: ["raises-exception"]},
    )
    check_local_cell(notebook.cells[2])
    assert "dtrain: job " in stream(notebook.cells[2], "stderr")
    error = next(o for o in notebook.cells[3].outputs if o["output_type"] == "error")
    assert error["ename"] == "RankFailed"
    assert error["evalue"].startswith("rank 1 on localhost raised FloatingPointError: loss is nan")
    # The traceback from the rank, its frame named after the cell, with the cell's line:
    assert 'raise FloatingPointError("loss is nan")' in error["evalue"]
    assert "in diverge" in error["evalue"]
    # ...and so does the rank's own traceback, in its tagged stderr lines:
    assert '[1]<stderr>     raise FloatingPointError("loss is nan")' in stream(
        notebook.cells[3], "stderr"
    )
    assert "again [0, 1]" in stream(notebook.cells[4])


def collect_reply(client: Any, msg_id: str, timeout: float) -> tuple[dict[str, Any], str]:
    """The kernel's reply to ``msg_id`` and the cell's stdout until then."""
    out: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            message = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(
                f"no reply in {timeout} s; stdout so far: {''.join(out)}"
            ) from None
        parent = message["parent_header"].get("msg_id")
        content = message["content"]
        if parent == msg_id and message["msg_type"] == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        idle = message["msg_type"] == "status" and content["execution_state"] == "idle"
        if parent == msg_id and idle:
            return shell_reply(client, msg_id), "".join(out)


def shell_reply(client: Any, msg_id: str) -> dict[str, Any]:
    """The reply to ``msg_id`` (a kernel_info reply of the start may come first)."""
    while True:
        reply = client.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"])


def wait_for_stdout(client: Any, msg_id: str, wanted: str, timeout: float) -> str:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while wanted not in "".join(seen):
        message = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
            seen.append(message["content"]["text"])
    return "".join(seen)


@pytest.fixture
def kernel() -> Iterator[tuple[Any, Any]]:
    manager, client = jupyter_client.manager.start_new_kernel(
        kernel_name="python3", env=child_env(), cwd=str(REPO)
    )
    try:
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_interrupting_the_kernel_leaves_no_process_and_a_second_launch_works(
    kernel: tuple[Any, Any], mark: str
) -> None:
    manager, client = kernel
    second = f"{mark}-second"
    code = (
        setup_cell(mark)
        + "\n"
        + textwrap.dedent(
            """
        import time
        from launcher import launch

        def wait():
            print("ready", flush=True)
            time.sleep(120)

        launch(wait, np=4, job_dir=JOB_DIR, env=MARKED)
        """
        )
    )
    msg_id = client.execute(code)
    wait_for_stdout(client, msg_id, "ready", timeout=60)
    manager.interrupt_kernel()
    reply, _ = collect_reply(client, msg_id, timeout=60)
    assert (reply["status"], reply.get("ename")) == ("error", "KeyboardInterrupt"), reply
    assert wait_until_gone(mark, timeout=10) == []
    again = (
        "def double(x):\n    return 2 * x\n"
        f"print('again', launch(double, (21,), np=2, job_dir=JOB_DIR, env={{{MARK!r}: "
        f"{second!r}}}).values)"
    )
    msg_id = client.execute(again)
    reply, out = collect_reply(client, msg_id, timeout=60)
    assert reply["status"] == "ok", reply
    assert "again (42, 42)" in out
    assert wait_until_gone(second) == []


def test_a_notebook_launches_on_4_local_ranks_then_on_2_ssh_hosts(
    ssh_hosts: TestHosts, mark: str
) -> None:
    notebook = run_notebook(
        [
            setup_cell(mark, SSH_CONFIG=str(ssh_hosts.ssh_config)),
            DEFINE,
            "result = launch(train, (10,), np=4, job_dir=JOB_DIR, env=MARKED)\n"
            "print('values', [v['value'] for v in result.values])",
            "remote = launch(train, (3,), hosts='node1,node2', ssh_config=SSH_CONFIG,\n"
            "                job_dir=JOB_DIR, env=MARKED)\n"
            "print('remote', [(v['rank'], v['value'], v['host']) for v in remote.values])",
        ]
    )
    check_local_cell(notebook.cells[2])
    out = stream(notebook.cells[3]).splitlines()
    hosts = ["node1", "node2"] if ssh_hosts.mode == "netns" else [None, None]
    values = [(0, 0, hosts[0]), (1, 3, hosts[1])]
    shown = next(line for line in out if line.startswith("remote "))
    if ssh_hosts.mode == "netns":
        assert shown == f"remote {values}"
    for rank, host in enumerate(("node1", "node2")):
        assert f"[{rank}@{host}] rank {rank} of 2 training" in out, out
    assert any(line.endswith("] epoch 1 done") for line in out)


@pytest.mark.slow  # torch on every rank
def test_the_ddp_example_notebook_runs_as_written(mark: str) -> None:
    pytest.importorskip("torch")
    notebook = nbformat.read(REPO / "examples" / "notebook_ddp.ipynb", as_version=4)
    execute(notebook, {**child_env(), MARK: mark})
    text = "".join(stream(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "[0] epoch 3 loss " in text and "[1] epoch 3 loss " in text, text
    assert "the ranks agree on the weights: True" in text
