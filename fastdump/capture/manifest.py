"""What a dump says about itself at attach: the root's fastdump.json, its record of the roles and
sessions attached (fastdump.roles/<role>, fastdump.sessions/<role>/<rank directory>), and the device facts sent with a channel's open message (the
writer puts them in rank.json)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from .. import format as _fmt
from ..fsutil import atomic_write_json, create_json_once, is_real_dir, is_regular_file


def cuda_index(hint, facts: dict):
    """The CUDA device to prepare at attach: the `device=` hint ('cuda:1', 1, torch.device) or the
    model's; None when neither is CUDA."""
    if hint is not None:
        text = str(hint)
        if isinstance(hint, int):
            return hint
        if text.startswith("cuda"):
            return int(text.split(":", 1)[1]) if ":" in text else 0
        return None
    return facts.get("index", 0) if facts.get("type") == "cuda" else None


def device_facts(model) -> dict:
    """The model's device as the open message carries it: type, and for CUDA the GPU's facts."""
    if model is None:
        return {}
    try:
        param = next(model.parameters())
    except (StopIteration, AttributeError, TypeError):
        return {}
    if param.device.type != "cuda":
        return {"type": param.device.type}
    try:
        from ..devices import device_facts as gpu_facts

        return dict(gpu_facts(param.device.index or 0), type="cuda", index=param.device.index or 0)
    except Exception as exc:
        return {"type": "cuda", "index": param.device.index or 0, "error": str(exc)}


def write_manifest(root: Path, config: dict, role: str, rank_dir: str) -> bool:
    """fastdump.json at the dump root, made once by the first Dumper on that root and never
    replaced: True when this Dumper made it. ``session`` names the Dumper whose ``config`` it holds
    (its role and rank directory), so that ``verify`` can hold the record against that session's
    rank.json. Made with ``create_json_once``: a check for the file then a rename let two processes
    attaching at once both write it, the later replacing the record the first had read back."""
    from .._version import __version__

    return create_json_once(str(root / _fmt.MANIFEST_FILE), {
        "format": "fastdump", "format_version": _fmt.MANIFEST_VERSION, "fastdump_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
        "command": sys.argv, "config": config, _fmt.MANIFEST_SESSION: {"role": role, "rank_dir": rank_dir},
    })


def write_role_marker(root: Path, role: str) -> None:
    """``fastdump.roles/<role>`` at the dump root, once this role's rank directory exists: the root's
    record that the role was attached, so that ``verify`` fails when its directory is later replaced,
    emptied or deleted (a role named neither target, draft nor in fastdump.json left no trace). Made
    by the first Dumper of the role and never rewritten; two processes attaching at once each write a
    temporary file and rename it into place (the same bytes: either rename leaves it whole)."""
    path = root / _fmt.ROLES_DIR / role
    if is_regular_file(str(path)):
        return
    _record_directory(path.parent, "the roles attached")
    atomic_write_json(str(path), {"role": role})


def write_session_marker(root: Path, role: str, rank_dir: str) -> None:
    """``fastdump.sessions/<role>/<rank directory name>`` at the dump root, once the session's rank
    directory exists: the root's record that this session was attached, so that ``verify`` fails
    when its rank directory is later removed while other sessions of its role remain (the role
    record alone cannot tell). The rank directory's name is this session's alone (made with an
    exclusive mkdir), so no two Dumpers write one marker."""
    role_dir = root / _fmt.SESSIONS_DIR / role
    for directory in (role_dir.parent, role_dir):
        _record_directory(directory, "the sessions attached")
    atomic_write_json(str(role_dir / rank_dir), {"role": role, "rank_dir": rank_dir})


def _record_directory(directory: Path, what: str) -> None:
    """Make ``directory`` (one of the root's records) if it is not there; refuse one that is no
    real directory: a link would take the record out of the dump."""
    try:
        directory.mkdir(exist_ok=True)
    except FileExistsError:  # (a file or a dangling link there: mkdir's "File exists" said no more)
        pass
    if not is_real_dir(str(directory)):
        raise FileExistsError(f"{directory} is not a directory: fastdump records {what} there")
