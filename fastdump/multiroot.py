"""Several dump roots read as one dump: ``fastdump.open([root1, root2, ...])``.

A multi-node run leaves one root per node, each holding some ranks of each role. ``MultiDumpSet``
offers the ``DumpSet`` reading API over all of them: roles are united, ranks merged. Two roots
holding the same role and rank (same global rank and DP rank, or the same rank directory name)
are refused: the dump would be ambiguous, and silently picking one would hide the other.
"""

from __future__ import annotations

import os

from .reader import DumpSet, _is_rank_number, _rank_dir_key


def open(root):  # noqa: A001 - exported as fastdump.open
    """Open a dump directory for reading; a list of directories (one per host of a multi-node run)
    reads as one dump with the ranks merged."""
    if isinstance(root, (list, tuple)):
        return MultiDumpSet(root)
    return DumpSet(root)


class MultiDumpSet:
    def __init__(self, roots):
        roots = [os.fspath(root) for root in roots]
        if not roots:
            raise ValueError("no dump roots given")
        self.sets = [DumpSet(root) for root in roots]
        self.roots = [ds.root for ds in self.sets]
        if len(set(self.roots)) != len(self.roots):
            self.close()
            raise ValueError(f"a dump root is given twice: {self.roots}")
        self.root = " + ".join(self.roots)
        try:
            self._owners = self._find_owners()  # (role, rank dir name) -> DumpSet
        except ValueError:
            self.close()
            raise

    def _find_owners(self) -> dict:
        """Which root holds each rank directory; ValueError for one rank in two roots."""
        owners: dict = {}
        seen: dict = {}  # (role, global rank, dp rank, session) -> path
        for ds in self.sets:
            for role in ds.roles:
                for name in ds.ranks(role):
                    path = os.path.join(ds.root, role, name)
                    if (role, name) in owners:
                        raise ValueError(f"duplicate rank directory {role}/{name} in "
                                         f"{owners[(role, name)].root} and {ds.root}")
                    entry = ds._rank_obj(role, name)
                    number = entry.rank_number()
                    ranks = entry.info.get("rank")
                    dp = ranks.get("dp_rank", 0) if isinstance(ranks, dict) else 0  # damaged: say 0
                    if number is not None:
                        key = (role, number, dp, entry.session)  # sessions of one rank are separate runs
                        if key in seen:
                            raise ValueError(f"duplicate rank: role {role!r} rank {number} (dp {dp}) is in both "
                                             f"{seen[key]} and {path}")
                        seen[key] = path
                    owners[(role, name)] = ds
        return owners

    @property
    def problems(self) -> list:
        return [problem for ds in self.sets for problem in ds.problems]

    @property
    def manifest(self) -> dict:
        return self.sets[0].manifest

    @property
    def roles(self) -> list:
        return sorted({role for role, _ in self._owners})

    def ranks(self, role: str = None) -> list:
        role = self._role(role)
        return sorted((name for r, name in self._owners if r == role), key=_rank_dir_key)

    def sessions(self, role: str = None, rank=None) -> list:
        """Rank directory names matching ``rank`` (a number, a directory name, or None for all)."""
        role = self._role(role)
        names = self.ranks(role)
        if rank is None:
            return names
        if not _is_rank_number(rank):
            if str(rank) not in names:
                raise KeyError(f"no rank {str(rank)!r} in role {role!r} (ranks: {names})")
            return [str(rank)]
        return [n for n in names if self._owners[(role, n)]._rank_obj(role, n).rank_number() == int(rank)]

    def _role(self, role):
        if role is not None:
            if role not in self.roles:
                raise KeyError(f"no role {role!r} in {self.root} (roles: {self.roles})")
            return role
        if len(self.roles) != 1:
            raise ValueError(f"role must be given: {self.root} holds roles {self.roles}")
        return self.roles[0]

    def _owner(self, role, rank, session=None):
        """(DumpSet, role, rank directory name) for a rank given by name, number or None (and
        ``session``: several sessions of one rank number are a ValueError, as in DumpSet)."""
        role = self._role(role)
        names = self.ranks(role)
        if session is not None:
            names = [n for n in names if self._owners[(role, n)]._rank_obj(role, n).session == session]
        if rank is None:
            if len(names) != 1:
                raise ValueError(f"rank must be given: role {role!r} has ranks {names}; "
                                 "pass one as rank (fastdump show: --rank DIR)")
            name = names[0]
        elif _is_rank_number(rank):
            matches = [n for n in names if self._owners[(role, n)]._rank_obj(role, n).rank_number() == rank]
            for match in matches:  # (a directory renamed to another rank: DumpError, as in DumpSet)
                self._owners[(role, match)]._refuse_mislabelled(role, [match], int(rank))
            if not matches:
                raise KeyError(f"rank {rank} of role {role!r} is missing: {names}")
            if len(matches) > 1:
                raise ValueError(f"rank {rank} of role {role!r} has {len(matches)} sessions: {matches}; "
                                 "pass the directory name as rank, or session= (fastdump show: --rank DIR or --session S)")
            name = matches[0]
        else:
            name = str(rank)
            if name not in names:
                raise KeyError(f"no rank {name!r} in role {role!r} (ranks: {names})")
        return self._owners[(role, name)], role, name

    def rank_path(self, role: str = None, rank=None, *, session: str = None) -> str:
        ds, role, name = self._owner(role, rank, session)
        return os.path.join(ds.root, role, name)

    def refresh(self) -> None:
        """Read the roots again, as DumpSet.refresh does: roles and sessions made since are seen
        (a ValueError, as at open, when a rank is now in two roots)."""
        for ds in self.sets:
            ds.refresh()
        self._owners = self._find_owners()

    def close(self) -> None:
        for ds in getattr(self, "sets", []):
            ds.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self) -> str:
        return f"MultiDumpSet({self.roots!r}, roles={self.roles})"


def _delegate(method_name: str):
    def method(self, role: str = None, rank=None, *args, session: str = None, **kwargs):
        ds, role, name = self._owner(role, rank, session)
        return getattr(ds, method_name)(role, name, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = getattr(DumpSet, method_name).__doc__
    return method


for _name in ("rank_info", "segments", "passes", "summary", "names", "meta", "structure", "load", "pass_names",
              "tensor", "series"):
    setattr(MultiDumpSet, _name, _delegate(_name))
