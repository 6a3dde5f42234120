"""The ``fastdump`` command: info, ls, verify, show, diff, export."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys


def info() -> dict:
    """What this installation can do: versions, CUDA compiled in or not, GPUs seen, settings."""
    import h5py

    from .. import _C
    from .._version import __version__
    from ..config import OTHER_VARS, env_table

    facts = {
        "fastdump": __version__,
        "python": platform.python_version(),
        "h5py": h5py.version.version,
        "hdf5": h5py.version.hdf5_version,
        "cuda": _C.cuda_info(),
        "environment": env_table(),
        "other_environment": dict(OTHER_VARS),
    }
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
    except ImportError:
        facts["torch"] = None
    from ..staging import tensor_reader

    facts["tensor_reader"] = tensor_reader.describe()
    facts["environment_now"] = environment_now()
    return facts


def environment_now(environ=None) -> dict:
    """The FASTDUMP_* variables set here and what maybe_attach makes of them: ``set`` {name: value},
    ``error`` (the ConfigError it would raise, or None), ``warnings`` (misspelt names). The table
    above it only documents; an operator checking the flag before a run saw no fault in it."""
    import os
    import warnings

    from ..config import ConfigError, parse_env

    environ = os.environ if environ is None else environ
    out = {"set": {k: v for k, v in sorted(environ.items()) if k.startswith("FASTDUMP_")}, "error": None,
           "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parse_env(environ)
        except ConfigError as exc:
            out["error"] = str(exc)
    out["warnings"] = [str(w.message) for w in caught]
    return out


def cmd_info(args) -> int:
    facts = info()
    if args.json:
        print(json.dumps(facts, indent=2, default=str))
        return 1 if facts["environment_now"]["error"] else 0
    cuda = facts["cuda"]
    print(f"fastdump {facts['fastdump']}  python {facts['python']}  torch {facts['torch']}")
    print(f"h5py {facts['h5py']}  HDF5 {facts['hdf5']}")
    reader = facts["tensor_reader"]
    print(f"tensor reader: {reader['reader']} ({reader['why']})")
    if cuda.get("compiled"):
        print(f"CUDA compiled in (built with {cuda.get('built_with')}); runtime {cuda.get('runtime_version')}, "
              f"driver {cuda.get('driver_version')}")
        for dev in cuda.get("devices", []):
            print(f"  GPU {dev.get('index')}: {dev.get('name')} {dev.get('uuid', '')}")
        if not cuda.get("devices"):
            print(f"  no usable GPU: {cuda.get('reason', 'none found')} (CPU path only)")
    else:
        print(f"CUDA not compiled in: {cuda.get('reason', '')} (CPU path only)")
    # One column for both lists, as wide as the longest name (FASTDUMP_CUDA_CHECK_EACH_TENSOR).
    width = max(len(name) for name in [row["name"] for row in facts["environment"]] + list(facts["other_environment"]))
    print("settings (environment):")
    for row in facts["environment"]:
        print(f"  {row['name']:<{width}} {row['doc']}")
    print("other variables:")
    for name, doc in facts["other_environment"].items():
        print(f"  {name:<{width}} {doc}")
    now = facts["environment_now"]
    print("set in this environment:" if now["set"] else "set in this environment: none")
    for name, value in now["set"].items():
        print(f"  {name}={value!r}")
    for text in now["warnings"]:
        print(f"warning: {text}")
    if now["error"]:
        print(f"ERROR: {now['error']}")
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import compare, export
    from . import dump as cli_dump

    parser = argparse.ArgumentParser(
        prog="fastdump", description="Check, list, show, compare and export activation dumps written by "
        "fastdump.attach. ROOT is the directory given to attach (it holds fastdump.json and one "
        "directory per role).", epilog="fastdump COMMAND --help describes each command.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, CUDA support, GPUs, settings")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    cli_dump.add_arguments(sub)
    compare.add_arguments(sub)
    export.add_arguments(sub)
    return parser


def main(argv=None) -> int:
    from ..reader import DumpError

    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # (a closed pipe shows here, not in a traceback at interpreter exit)
        return code
    except BrokenPipeError:
        # `fastdump show ... | head`: the reader of the output stopped reading. Quiet, as a command a
        # shell's SIGPIPE ends, and with its status (128 + 13); nothing more goes to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except DumpError as exc:  # a damaged or crafted dump: say which file and why, no traceback
        from ..format import printable

        print(f"fastdump {args.command}: {printable(exc)}", file=sys.stderr)
        return 2 if args.command == "diff" else 1  # diff: 1 means "the dumps differ"


if __name__ == "__main__":
    sys.exit(main())
