"""launcher/base/codecache.py: dataclass methods compiled once and kept, never wrong."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from pathlib import Path

from launcher.base.codecache import CodeCache

DEFINE = """
import dataclasses, sys
from pathlib import Path
from launcher.base.codecache import CodeCache
cache = CodeCache(Path(sys.argv[1]))
compiled = []
def counting(source, *args):
    if isinstance(source, str) and source not in cache.codes:
        compiled.append(source)
    cache.exec(source, *args)
dataclasses.exec = counting

@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 2

p = Point(1)
assert (p, repr(p), hash(p) == hash(Point(1, 2))) == (Point(1, 2), "Point(x=1, y=2)", True)
try:
    p.x = 3
except dataclasses.FrozenInstanceError:
    pass
else:
    raise AssertionError("not frozen")
cache.save()
print(len(compiled))
"""


def define(path: Path, **env: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", DEFINE, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_the_second_start_compiles_nothing_and_behaves_the_same(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "codes.bin"
    env = {"PYTHONDONTWRITEBYTECODE": ""}
    assert define(path, **env) >= 5  # __init__, __repr__, __eq__, __setattr__, __hash__...
    assert path.exists()
    assert define(path, **env) == 0  # all taken from the file, the asserts hold
    assert list(path.parent.iterdir()) == [path]  # no temporary left


def test_nothing_is_written_where_bytecode_is_not(tmp_path: Path) -> None:
    path = tmp_path / "codes.bin"
    assert define(path, PYTHONDONTWRITEBYTECODE="1") >= 5
    assert not path.exists()


def test_an_unwritable_place_and_a_damaged_file_only_cost_a_compile(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert define(blocker / "codes.bin", PYTHONDONTWRITEBYTECODE="") >= 5  # cannot mkdir
    damaged = tmp_path / "codes.bin"
    damaged.write_bytes(b"\x00garbage")
    assert define(damaged, PYTHONDONTWRITEBYTECODE="") >= 5
    assert define(damaged, PYTHONDONTWRITEBYTECODE="") == 0  # written anew


def test_a_changed_text_misses_instead_of_running_stale_code(tmp_path: Path) -> None:
    path = tmp_path / "codes.bin"
    stale = compile("def __create_fn__():\n def f(): return 'stale'\n return f", "<s>", "exec")
    path.write_bytes(marshal.dumps({"something else": stale}))
    cache = CodeCache(path)
    namespace: dict[str, object] = {}
    cache.exec("def __create_fn__():\n def f(): return 'fresh'\n return f", {}, namespace)
    made = namespace["__create_fn__"]
    assert callable(made) and made()() == "fresh"
    assert cache.added
