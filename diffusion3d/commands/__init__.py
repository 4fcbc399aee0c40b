"""The command-line layer: each module parses flags, checks input, calls the library and picks the exit code.

``python -m diffusion3d <command>`` (``__main__``) and the ``diffusion3d-<command>`` console scripts run
them; the library never imports this package (``tests/test_architecture.py``).
"""

COMMANDS = {  # name → module in this package; each has ``main(argv)``
    "train": "train",
    "sample": "sample",
    "evaluate": "evaluate",
    "bench": "bench",
    "quality": "quality",
}
