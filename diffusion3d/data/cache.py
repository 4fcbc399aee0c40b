"""The training set, decoded and transformed once: in memory, on disk (keyed by settings and file stats), or not."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import monai
from monai.data import CacheDataset, Dataset, PersistentDataset

from ..config import Config, keys_where
from .discovery import Case
from .transforms import training_transforms


def data_items(cases: Sequence[Case], with_mask: bool) -> list[dict[str, Any]]:
    """The file dicts the MONAI transforms read: several image files of a case load as channels."""
    items = []
    for c in cases:
        item: dict[str, Any] = {"image": [str(p) for p in c.images] if len(c.images) > 1 else str(c.images[0])}
        if with_mask:
            item["mask"] = str(c.mask)
        items.append(item)
    return items


def transform_key(cfg: Config) -> str:
    """A short hash of every setting the cached tensors depend on (the keys whose metadata says ``cache``,
    and MONAI's version): a changed setting gets a fresh cache."""
    keys = keys_where("cache")
    # data keys in one list in field order, the others by name: the layout the hash had before the metadata
    # named these keys, so caches already on disk stay valid
    relevant: dict[str, Any] = {
        name: getattr(getattr(cfg, section), name)
        for section, names in keys.items()
        if section != "data"
        for name in names
    }
    relevant["transforms"] = [getattr(cfg.data, name) for name in keys.get("data", ())]
    relevant["monai"] = monai.__version__
    return hashlib.sha1(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:12]


def _item_hash(item: dict[str, Any]) -> bytes:
    """Cache file name of an item: its paths plus each file's size and mtime, so an edited file is re-read."""
    paths = [p for v in item.values() for p in (v if isinstance(v, list) else [v])]
    stats = [(p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths]
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest().encode()


def build_dataset(cases: Sequence[Case], cfg: Config, cache_dir: Path | None = None):
    """Decoded and transformed once: in memory, on disk, or (cache: none) every time.

    Items keep their metadata (MetaTensors); the loader hands plain tensors to the model.
    """
    items = data_items(cases, cfg.model.with_condition)
    transform = training_transforms(cfg, keep_meta=True)
    kind = cfg.data.cache
    if kind == "memory":
        return CacheDataset(
            items, transform, cache_rate=1.0, num_workers=max(cfg.data.num_workers, 1), progress=False, copy_cache=False
        )
    if kind == "disk":
        if cache_dir is None:
            raise ValueError("cache: disk needs a cache_dir")
        folder = Path(cache_dir) / transform_key(cfg)
        folder.mkdir(parents=True, exist_ok=True)
        # reset_ops_id would put a TraceKeys enum back into the metadata, which the safe loader refuses
        return PersistentDataset(
            items, transform, cache_dir=folder, hash_func=_item_hash, track_meta=True, reset_ops_id=False
        )
    return Dataset(items, transform)
