"""``python -m diffusion3d <command> [flags]``: train, sample, evaluate, bench or quality."""

from __future__ import annotations

import importlib
import sys

from .commands import COMMANDS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}; " if argv and argv[0] not in ("-h", "--help") else ""
        print(
            f"usage: python -m diffusion3d {{{','.join(COMMANDS)}}} [flags]\n{given}each command has --help",
            file=sys.stderr if given else sys.stdout,
        )
        sys.exit(2 if given or not argv else 0)
    module = importlib.import_module(f".commands.{COMMANDS[argv[0]]}", __package__)
    sys.argv[0] = f"python -m diffusion3d {argv[0]}"
    sys.exit(module.main(argv[1:]))


if __name__ == "__main__":
    main()
