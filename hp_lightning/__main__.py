"""``python -m hp_lightning <command>``: ``plan`` (the planner; see ``docs/planning.md``)."""

from __future__ import annotations

import sys

COMMANDS = {"plan": "rank FSDP/HSDP x TP x PP plans for a model on a cluster, before renting it"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:<8} {text}" for name, text in COMMANDS.items())
        print(f"usage: python -m hp_lightning <command> [args]\n\ncommands:\n{listing}", file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    from hp_lightning.planner.cli import main as plan_main

    return plan_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
