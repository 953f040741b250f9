"""Whose files dtrain obeys (issue 33, DESIGN rule 14): ``base/trust.py`` on real folders, and
the job root refused when a real second user owns it (the project file's cases are in
tests/test_project_file.py).

The suite runs as root, so "the user" is root: root's own entries are trusted, and what the
second user (``other_user``, a real account made by useradd) writes is not.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import uuid
from pathlib import Path

import pytest

from launcher.base.errors import UsageError
from launcher.base.trust import (
    Doubt,
    config_path,
    doubt_of,
    others_may_write,
    trust_doubt,
    trusted_folders,
)
from tests.conftest import child_env, run_dtrain
from tests.otheruser import OtherUser

ME = os.geteuid()


def private_file(folder: Path, text: str = "x\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "file"
    path.write_text(text)
    path.chmod(0o644)
    return path


def write_config(folder: Path, text: str) -> Path:
    path = folder / "dtrain" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_the_users_own_file_in_private_folders_is_trusted(tmp_path: Path) -> None:
    path = private_file(tmp_path / "a" / "b")
    assert doubt_of(str(path)) is None


def test_a_file_others_may_write_is_doubted_and_so_is_its_folder(tmp_path: Path) -> None:
    path = private_file(tmp_path / "a")
    path.chmod(0o666)
    assert doubt_of(str(path)) == Doubt(str(path), str(path), mode=0o666)
    path.chmod(0o644)
    (tmp_path / "a").chmod(0o777)
    assert doubt_of(str(path)) == Doubt(str(path), str(tmp_path / "a"), mode=0o777)
    assert doubt_of(str(path)).said() == (  # type: ignore[union-attr]
        f"{tmp_path / 'a'} is writable by group or others (mode 0777)"
    )


def test_a_sticky_folder_above_is_fine_but_not_the_path_itself(tmp_path: Path) -> None:
    """As OpenSSH and /tmp: in a sticky folder nobody may rename or remove another's entry."""
    shared = tmp_path / "shared"
    path = private_file(shared)
    shared.chmod(0o1777)
    assert doubt_of(str(path)) is None
    assert doubt_of(str(shared)) == Doubt(str(shared), str(shared), mode=0o1777)
    assert doubt_of(str(shared), parents_only=True) is None


def test_a_missing_path_is_judged_by_the_folders_there(tmp_path: Path) -> None:
    assert doubt_of(str(tmp_path / "not" / "yet")) is None
    tmp_path.chmod(0o777)
    try:
        assert doubt_of(str(tmp_path / "not" / "yet")) == Doubt(
            str(tmp_path / "not" / "yet"), str(tmp_path), mode=0o777
        )
    finally:
        tmp_path.chmod(0o700)


def test_a_link_is_judged_where_it_leads_too(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    target = private_file(loose)
    loose.chmod(0o777)
    link = tmp_path / "private" / "link"
    link.parent.mkdir()
    link.symlink_to(target)
    assert doubt_of(str(link)) == Doubt(str(link), str(loose), mode=0o777)


def test_another_users_link_to_the_users_own_file_is_doubted(
    shared_tmp: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    """``/tmp/dtrain.toml -> ~/mine.toml`` planted by another user: the file is ours, but
    which of our files steers the run was their choice (reviewer: it was applied)."""
    mine = private_file(tmp_path / "mine")
    link = shared_tmp / "dtrain.toml"
    other_user.sh(f"ln -s '{mine}' '{link}'")
    assert doubt_of(str(link)) == Doubt(str(link), str(link), owner=other_user.uid)
    assert doubt_of(str(link), trusted=[str(shared_tmp)]) is None
    os.unlink(link)
    link.symlink_to(mine)  # our own link: where it leads decides
    assert doubt_of(str(link)) is None


def test_the_hint_never_suggests_trusting_a_folder_everyone_may_write(
    shared_tmp: Path, tmp_path: Path
) -> None:
    loose = private_file(shared_tmp / "team")
    loose.chmod(0o664)
    os.chown(loose, ME, 4242)  # (a group of no one's: group write is not harmless)
    doubt = doubt_of(str(loose))
    assert doubt is not None and "trusted" in doubt.fix()  # team: 0755, a team may be listed
    (shared_tmp / "team").chmod(0o1777)
    assert doubt_of(str(loose)) == doubt and "trusted" not in doubt.fix()
    assert doubt.fix() == f"chmod go-w {loose}"


def test_group_write_is_harmless_in_the_owners_own_group(
    tmp_path: Path, other_user: OtherUser
) -> None:
    """A umask 002 system's files are group-writable in the user's private group (Debian's
    OpenSSH allows it); a group with someone else in it is not."""
    path = private_file(tmp_path / "a")
    path.chmod(0o664)
    os.chown(path, ME, os.getegid())  # root's own group: gid 0, no other member here
    assert doubt_of(str(path)) is None
    os.chown(path, ME, other_user.gid)  # the other user's group
    assert doubt_of(str(path)) == Doubt(str(path), str(path), mode=0o664)


def test_group_write_is_not_harmless_where_another_user_shares_that_primary_group(
    shared_tmp: Path, other_user: OtherUser
) -> None:
    """A group that is another user's primary group too (``users`` on systems where useradd
    puts everyone in it) lists neither in ``gr_mem``: that user may write a 0664 file of the
    owner's, so it is not the owner's own (reviewer: a dtrain.toml so written was applied)."""
    mate = f"dtrain-m{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        ["useradd", "--no-create-home", "--gid", str(other_user.gid), mate],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd {mate}: {made.stderr.strip()}")
    try:
        path = other_user.write(shared_tmp / "theirs.toml", "x = 1", mode=0o664)
        uid = pwd.getpwnam(mate).pw_uid
        subprocess.run(  # (the mate can write it indeed)
            ["setpriv", f"--reuid={uid}", f"--regid={other_user.gid}", "--clear-groups",
             "sh", "-c", f"echo 'y = 2' >> '{path}'"],
            check=True,
        )  # fmt: skip
        assert "y = 2" in path.read_text()
        assert doubt_of(str(path), me=other_user.uid) == Doubt(str(path), str(path), mode=0o664)
        assert others_may_write(str(path), {"HOME": "/nonexistent"}) == Doubt(
            str(path), str(path), mode=0o664
        )
    finally:
        subprocess.run(["userdel", mate], capture_output=True, check=False)


def test_another_users_file_is_doubted_unless_its_folder_is_trusted(
    shared_tmp: Path, other_user: OtherUser
) -> None:
    path = other_user.write(shared_tmp / "theirs.toml", "x = 1")
    assert doubt_of(str(path)) == Doubt(str(path), str(path), owner=other_user.uid)
    assert doubt_of(str(path)).said() == f"owned by {other_user.name}"  # type: ignore[union-attr]
    assert doubt_of(str(path), trusted=[str(shared_tmp)]) is None
    other_user.sh(f"chmod 666 '{path}'")  # everyone's: no list trusts it
    assert doubt_of(str(path), trusted=[str(shared_tmp)]) == Doubt(str(path), str(path), mode=0o666)


def test_a_named_file_is_read_whoever_owns_it_but_not_if_others_may_write_it(
    shared_tmp: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    path = other_user.write(shared_tmp / "theirs.toml", "x = 1")
    assert others_may_write(str(path), {"HOME": str(tmp_path)}) is None
    other_user.sh(f"chmod 664 '{path}'")  # their own private group: harmless
    assert others_may_write(str(path), {"HOME": str(tmp_path)}) is None
    other_user.sh(f"chmod 646 '{path}'")
    assert others_may_write(str(path), {"HOME": str(tmp_path)}) == Doubt(
        str(path), str(path), mode=0o646
    )


def test_the_config_is_found_by_xdg_config_home_else_home() -> None:
    assert config_path({"XDG_CONFIG_HOME": "/x", "HOME": "/h"}) == "/x/dtrain/config.toml"
    assert config_path({"XDG_CONFIG_HOME": "rel", "HOME": "/h"}) == (
        "/h/.config/dtrain/config.toml"  # (a relative XDG_CONFIG_HOME is ignored, as XDG says)
    )
    assert config_path({"HOME": "/h"}) == "/h/.config/dtrain/config.toml"


def test_the_trusted_list(tmp_path: Path) -> None:
    environ = {"XDG_CONFIG_HOME": str(tmp_path), "HOME": "/home/someone"}
    assert trusted_folders(environ) == ()  # no config: nothing trusted
    write_config(tmp_path, 'trusted = ["/proj/team/", "~/shared"]\n')
    assert trusted_folders(environ) == ("/proj/team", "/home/someone/shared")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("trusted = [\n", "config.toml: "),
        ('trusted = "/proj"\n', "trusted must be a list of folders"),
        ('trusted = ["proj"]\n', "trusted 'proj' is not an absolute path"),
        ('trust = ["/proj"]\n', "no setting 'trust'"),
        ("trusted = [1]\n", "trusted must be a list of folders"),
        ('trusted = ["/p"]\0\n', "a binary file"),
    ],
)
def test_a_bad_config_is_one_usage_error(tmp_path: Path, text: str, said: str) -> None:
    write_config(tmp_path, text)
    with pytest.raises(UsageError, match=said):
        trusted_folders({"XDG_CONFIG_HOME": str(tmp_path)})


def test_a_config_others_may_write_is_refused(tmp_path: Path) -> None:
    path = write_config(tmp_path, 'trusted = ["/"]\n')
    path.chmod(0o666)
    with pytest.raises(UsageError) as caught:
        trusted_folders({"XDG_CONFIG_HOME": str(tmp_path)})
    assert str(caught.value.message) == (
        f"{path}: writable by group or others (mode 0666): dtrain trusts no list there"
    )


def test_the_config_is_read_only_when_a_path_fails_without_it(tmp_path: Path) -> None:
    """A bad config does not stop a launch whose files are the user's own (nothing read)."""
    write_config(tmp_path, "not toml [")
    environ = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert trust_doubt(str(private_file(tmp_path / "mine")), environ) is None
    loose = private_file(tmp_path / "loose")
    loose.chmod(0o664)
    os.chown(loose, ME, 65534)
    with pytest.raises(UsageError):
        trust_doubt(str(loose), environ)


# -- the job root, with a real second user ---------------------------------------------


def one_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: "), lines
    return lines[0]


def test_a_job_root_the_other_user_made_is_refused(shared_tmp: Path, other_user: OtherUser) -> None:
    root = shared_tmp / "jobs"
    other_user.sh(f"mkdir -m 700 '{root}'")
    line = one_error(run_dtrain("jobs", "--job-dir", str(root)))
    assert line == (
        f"dtrain: error: --job-dir {root}: owned by {other_user.name} (uid {other_user.uid}), "
        "not by you: another user's jobs cannot be trusted (hint: use a directory of your "
        "own: --job-dir ~/.dtrain/jobs, or another)"
    )
    theirs = shared_tmp / "theirs"
    other_user.sh(f"mkdir -m 755 '{theirs}'")
    (theirs / "jobs").mkdir(mode=0o700)  # ours, in their folder: they could swap it
    line = one_error(run_dtrain("run", "--job-dir", str(theirs / "jobs"), "-np", "1", "true"))
    assert line.startswith(
        f"dtrain: error: --job-dir {theirs / 'jobs'}: its folder {theirs} is owned by "
        f"{other_user.name} (uid {other_user.uid}): another user could swap the jobs"
    )


def test_a_job_root_in_a_trusted_team_folder_is_used(
    shared_tmp: Path, other_user: OtherUser, tmp_path: Path
) -> None:
    team = shared_tmp / "team"
    team.mkdir()
    os.chown(team, ME, other_user.gid)
    team.chmod(0o2775)  # the team (the other user's group) may write
    root = team / "jobs"
    env = {**child_env(), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    assert "its folder" in one_error(run_dtrain("jobs", "--job-dir", str(root), env=env))
    write_config(tmp_path / "config", f'trusted = ["{team}"]\n')
    done = run_dtrain("run", "--job-dir", str(root), "-np", "1", "true", env=env)
    assert done.returncode == 0, done.stderr
