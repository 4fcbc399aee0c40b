"""The configs shipped inside the package: ``default`` (the demo) and ``whole_head_128`` (Med-DDPM's setup).

They are package data found through ``importlib.resources``, so a wheel or a non-editable install finds
them as a source checkout does. Every command's ``--config`` takes a path or one of these names.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..config import ConfigError

SUFFIX = ".yaml"
# a plain install unpacks the package on disk, where files() is a pathlib.Path; yaml is read from a path
_FOLDER = Path(str(resources.files(__name__)))
DEFAULT = _FOLDER / f"default{SUFFIX}"


def names() -> list[str]:
    """The bundled configs' names, sorted."""
    return sorted(p.name[: -len(SUFFIX)] for p in _FOLDER.iterdir() if p.name.endswith(SUFFIX))


def find(config: str | Path | None) -> Path:
    """``config`` as a file if one exists there, else the bundled config of that name (``whole_head_128``
    or ``whole_head_128.yaml``); None is the default. ConfigError names what matched neither."""
    if config is None:
        return DEFAULT
    path = Path(config)
    if path.is_file():
        return path
    bundled = _FOLDER / (path.name if path.name.endswith(SUFFIX) else path.name + SUFFIX)
    if path.name == str(config) and bundled.is_file():  # a bare name, not a path with folders
        return bundled
    raise ConfigError(f"{config}: config file not found (bundled configs: {', '.join(names())})")
