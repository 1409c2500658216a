"""``python -m oslo <command>``: tools that work on checkpoints and models without writing a script.

Commands:
    reshard  Convert a checkpoint between parallel layouts, or to/from a plain transformers checkpoint, in one
             process without GPUs (see :mod:`oslo.reshard`).
    check    Compare an oslo model at a parallel layout with transformers on the same weights (see
             :mod:`oslo.check`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> module defining ``add_arguments(parser)``, ``main(args) -> int`` and a one-line ``HELP``
_COMMANDS = {"reshard": "oslo.reshard", "check": "oslo.check"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oslo", description="oslo's command-line tools.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = {}
    for name, module_name in _COMMANDS.items():
        module = importlib.import_module(module_name)
        modules[name] = module
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
    args = parser.parse_args(argv)
    return modules[args.command].main(args)


if __name__ == "__main__":
    sys.exit(main())
