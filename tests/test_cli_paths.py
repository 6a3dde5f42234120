"""Hostile paths given to the commands that read a dump (ls, verify, show, diff, export): each says
what is wrong with the path it was given, in plain words, with the exit status its --help documents,
and never a temporary file's name or a raw escape sequence."""

import os
import shutil
import stat

import pytest
import torch

import fastdump
from fastdump import cli

_EXIT_NO_DUMP = {"ls": 1, "verify": 1, "show": 1, "diff": 2, "export": 2}


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out + err


def argv_for(command, path, dump, tmp_path):
    if command == "show":
        return ["show", path, "--pass", "0"]
    if command == "diff":
        return ["diff", dump, path]
    if command == "export":
        return ["export", path, tmp_path / "out"]
    return [command, path]


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_paths") / "dump"
    model = torch.nn.Linear(4, 4)
    with fastdump.attach(model, root, writer="thread"):
        model(torch.ones(2, 4))
    return root


def hostile_paths(tmp_path):
    """(path, what the message must say) for paths that are no directory one can read."""
    regular = tmp_path / "a_file"
    regular.write_text("x")
    fifo = tmp_path / "a_fifo"
    os.mkfifo(fifo)
    loop = tmp_path / "loop1"
    os.symlink(tmp_path / "loop2", loop)
    os.symlink(loop, tmp_path / "loop2")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nothing here", dangling)
    return [("/dev/null", "not a directory: a character device"),
            (regular, "not a directory: a regular file"),
            (fifo, "not a directory: a FIFO (named pipe)"),
            (loop, "a symbolic link loop"),
            (dangling, "a symbolic link to nothing"),
            (regular / "below", "a part of its path is not a directory"),
            (tmp_path / "missing\n\x1b]2;title\x07", "no such file or directory")]


@pytest.mark.parametrize("command", sorted(_EXIT_NO_DUMP))
def test_a_path_that_is_no_readable_directory_is_named_for_what_it_is(command, dump, tmp_path, capsys):
    """`fastdump verify /dev/null` (a regular file, a FIFO, a symbolic link loop) said "no such
    directory", the others "no dump directory at ..." alike for all of them: each says what the
    path is now. A name with a newline and an escape sequence is shown escaped."""
    for path, said in hostile_paths(tmp_path):
        code, text = run(capsys, *argv_for(command, path, dump, tmp_path))
        assert code == _EXIT_NO_DUMP[command], (path, text)
        assert said in text, (command, path, text)
        assert "\x1b" not in text and "\x07" not in text and "no such directory" not in text, text
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", sorted(_EXIT_NO_DUMP))
def test_a_directory_that_cannot_be_listed_says_so(command, dump, tmp_path, capsys, monkeypatch):
    """A directory its reader may not list (mode 000 for anyone but root; the test runs as root, so
    the refusal is the file system's answer, faked): verify said "cannot list" and then "no rank
    directories" as a second problem; ls, show, diff and export printed "[Errno 13] Permission
    denied: '...'"."""
    locked = tmp_path / "locked"
    locked.mkdir()
    real_scandir, real_listdir = os.scandir, os.listdir

    def refused(real):
        def call(path="."):
            if os.fspath(path) == str(locked):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real(path)
        return call

    monkeypatch.setattr(os, "scandir", refused(real_scandir))
    monkeypatch.setattr(os, "listdir", refused(real_listdir))
    code, text = run(capsys, *argv_for(command, locked, dump, tmp_path))
    assert code == _EXIT_NO_DUMP[command], text
    assert "cannot be listed: Permission denied" in text and "Errno" not in text, text
    assert "no rank directories" not in text, text


def test_diff_html_that_cannot_be_written_names_the_path_given(dump, capsys):
    """`--html /proc/x` passes the checks made before the comparison (/proc is a directory root
    may write to, by its mode) and fails at the write: the error named the temporary file
    ('/proc/.x.123-0-....tmp'), not the report asked for."""
    code, text = run(capsys, "diff", dump, dump, "--html", "/proc/fastdump-report.html")
    assert code == 2, text
    assert "--html '/proc/fastdump-report.html': cannot be written (" in text, text
    assert ".tmp" not in text, text


def test_export_of_a_role_directory_names_the_dump_root(dump, tmp_path, capsys):
    """ls, show, verify and diff of a role directory name the dump root meant; export said only
    "wrote 0 pass file(s)" (exit 1, as for a dump with no passes) and made OUT."""
    role_dir = dump / "target"
    for fmt in ("sglang", "sglang-dumper"):
        code, text = run(capsys, "export", "--format", fmt, role_dir, tmp_path / "out")
        assert code == 2, text
        assert f"{role_dir} is a role directory; its dump root is {dump}" in text, text
        assert "wrote 0" not in text and not (tmp_path / "out").exists()


def test_export_exit_status_is_2_for_every_dump_it_cannot_read(dump, tmp_path, capsys):
    """export exited 1 for a dump it could not read (an unreadable segment, no dump there: as for
    "nothing written") and 2 for a malformed rank.json (as for a refusal): every read error is 2
    now, as diff's, and 1 means only that nothing was written."""
    code, text = run(capsys, "export", tmp_path / "nowhere", tmp_path / "out")
    assert code == 2 and "no such file or directory" in text, text
    (rank_dir,) = (dump / "target").iterdir()
    damaged = tmp_path / "damaged"
    shutil.copytree(dump, damaged)
    (segment,) = (damaged / "target" / rank_dir.name).glob("seg-*.h5")
    os.chmod(segment, stat.S_IRUSR | stat.S_IWUSR)
    segment.write_bytes(b"not an HDF5 file" * 64)
    code, text = run(capsys, "export", damaged, tmp_path / "out")
    assert code == 2, text
    assert "seg-" in text and not (tmp_path / "out").exists()


def test_out_paths_are_named_and_shown_escaped(dump, tmp_path, capsys):
    """export's "wrote N pass file(s) under OUT" and diff's "report: REPORT" printed the names as
    given: a newline and an escape sequence (a terminal's title set) reached the terminal raw. An
    OUT that cannot be made said "[Errno 2] No such file or directory: '/proc/x'", not that it is
    OUT."""
    odd = "out\n\x1b]2;title\x07"
    code, text = run(capsys, "export", dump, tmp_path / odd)
    assert code == 0 and "\x1b" not in text and "\x07" not in text and "out\\n\\x1b]2;title\\x07" in text, text
    report = tmp_path / ("report\x1b]2;t\x07.html")
    code, text = run(capsys, "diff", dump, dump, "--html", report)
    assert code == 0 and report.exists() and "\x1b" not in text and "report: " in text, text
    code, text = run(capsys, "export", dump, "/proc/fastdump-out")
    assert code == 2 and "OUT /proc/fastdump-out: cannot be made (No such file or directory)" in text, text
