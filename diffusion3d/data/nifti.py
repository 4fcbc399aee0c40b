"""NIfTI files in and out: header checks before any voxel is read, reading one volume, writing one atomically."""

from __future__ import annotations

import gzip
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from ..storage import atomic_write
from .errors import DataError

NIFTI_SUFFIXES = (".nii.gz", ".nii")


@dataclass
class VolumeInfo:
    shape: tuple[int, ...]
    spacing: tuple[float, ...]
    orientation: str
    affine: np.ndarray


NIFTI_HEADER_SIZES = (348, 540)  # sizeof_hdr of NIfTI-1 and NIfTI-2


def _diagnose(path: Path) -> str:
    """Why nibabel could not open ``path``, in words a user can act on."""
    if path.stat().st_size == 0:
        return "empty file"
    try:
        if path.name.endswith(".gz"):
            with path.open("rb") as f:
                if f.read(2) != b"\x1f\x8b":
                    return "not gzip-compressed although named .gz"
            with gzip.open(path, "rb") as f:
                head = f.read(540)
        else:
            with path.open("rb") as f:
                head = f.read(540)
    except EOFError as e:
        return f"truncated file ({e})"
    except (gzip.BadGzipFile, zlib.error) as e:
        return f"corrupt gzip data ({e})"
    sizes = {int(np.frombuffer(head[:4], dtype=order + "i4")[0]) for order in "<>"} if len(head) >= 4 else set()
    if not sizes & set(NIFTI_HEADER_SIZES):
        return "not a NIfTI file (no NIfTI header)"
    if len(head) < 348:
        return f"truncated file (header of {len(head)} bytes)"
    return "not a readable NIfTI file"


GZIP_MAX_RATIO = 1032  # deflate cannot expand by more (RFC 1951 limits): bounds a .gz file's contents
DEFAULT_MAX_VOLUME_BYTES = 2 * 2**30


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def _datatype_problem(img) -> str | None:
    """None for a real integer or float datatype; else why the file's datatype cannot be an MRI volume."""
    header = img.header
    try:
        label = str(header.get_value_label("datatype"))
    except Exception:
        label = f"code {int(header['datatype'])}"
    try:
        dtype = header.get_data_dtype()
    except Exception:
        return f"datatype {label} is not supported (not a real integer or float type)"
    if dtype.kind in "iuf" and dtype.itemsize > 0:
        return None
    if dtype.fields is not None:  # RGB24 / RGBA32: structured R, G, B(, A) bytes
        return (
            f"datatype {label} ({len(dtype.fields)} colour channels per voxel) is not supported; "
            "save a greyscale volume (one channel per file)"
        )
    if dtype.kind == "c":
        return f"datatype {label} (complex voxels) is not supported; save the magnitude or the real part as float32"
    return f"datatype {label} is not supported (not a real integer or float type)"


def _gzip_content_size(path: Path, needed: int) -> int | None:
    """At least how many bytes ``path`` decompresses to, as far as needed to tell whether it holds
    ``needed`` bytes; None when it does. Decides from the gzip trailer (ISIZE, the size mod 2^32) and the
    compressed size where it can; otherwise (several gzip members, a damaged trailer) streams through the
    data in 1 MiB pieces, which allocates nothing the header claims."""
    compressed = path.stat().st_size
    bound = compressed * GZIP_MAX_RATIO + 2**16
    if needed > bound:
        return bound  # no deflate stream this short holds that much
    if compressed >= 18:
        with path.open("rb") as f:
            f.seek(-4, os.SEEK_END)
            isize = int.from_bytes(f.read(4), "little")
        smallest = needed + ((isize - needed) % 2**32)  # the smallest content size >= needed with this ISIZE
        if smallest <= bound:
            return None
    total = 0
    with gzip.open(path, "rb") as f:  # EOFError / BadGzipFile / zlib.error: the caller names them
        while piece := f.read(2**20):
            total += len(piece)
            if total >= needed:
                return None
    return total


def check_header(path: Path, img, max_bytes: int | None = DEFAULT_MAX_VOLUME_BYTES) -> tuple[int, ...]:
    """Datatype, dimensions and declared size of an opened (not yet read) NIfTI file; DataError naming
    the file. Nothing here reads voxels: a header cannot make anything allocate what it merely claims."""
    problem = _datatype_problem(img)
    if problem:
        raise DataError(f"{path}: {problem}")
    shape = tuple(int(n) for n in img.header.get_data_shape())
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) != 3:
        raise DataError(f"{path}: expected a 3D volume, got shape {shape}")
    if min(shape) < 1:
        raise DataError(f"{path}: header declares an empty volume (shape {shape})")
    dtype = img.header.get_data_dtype()
    nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
    declared = f"shape {shape} {dtype.name} ({_bytes(nbytes)})"
    offset = int(img.header.get_data_offset())
    needed = offset + nbytes
    if path.name.endswith(".gz"):
        try:
            holds = _gzip_content_size(path, needed)
        except EOFError as e:
            raise DataError(f"{path}: truncated file ({e})") from None
        except (gzip.BadGzipFile, zlib.error) as e:
            raise DataError(f"{path}: corrupt gzip data ({e})") from None
    else:
        size = path.stat().st_size
        holds = None if size >= needed else size
    if holds is not None:
        raise DataError(
            f"{path}: truncated file or wrong header: it declares {declared} of voxel data, "
            f"the file holds at most {_bytes(max(holds - offset, 0))}"
        )
    if max_bytes is not None and nbytes > max_bytes:
        raise DataError(
            f"{path}: header declares {declared}, over the ceiling of {_bytes(max_bytes)} per volume "
            "(max_volume_gb; raise it if the volume is real)"
        )
    return shape


def read_volume(path: Path, max_bytes: int | None = DEFAULT_MAX_VOLUME_BYTES) -> tuple[VolumeInfo, np.ndarray]:
    """Open, check the header (datatype, shape, declared size; see check_header), then read the voxels."""
    try:
        img = nib.load(str(path))
        check_header(path, img, max_bytes)
        data = np.asanyarray(img.dataobj)
    except DataError:
        raise
    except EOFError as e:
        raise DataError(f"{path}: truncated file ({e})") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip data ({e})") from None
    except nib.filebasedimages.ImageFileError:
        raise DataError(f"{path}: {_diagnose(path)}") from None
    except nib.spatialimages.HeaderDataError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        code = re.fullmatch(r"data code (-?\d+) not supported", first)
        if code:  # a datatype nibabel cannot decode (DT_BINARY, or a code outside the standard)
            n = int(code.group(1))
            label = nib.nifti1.data_type_codes.label[n] if n in nib.nifti1.data_type_codes.value_set() else "unknown"
            raise DataError(
                f"{path}: datatype {label} (code {n}) is not supported (not a real integer or float type)"
            ) from None
        raise DataError(f"{path}: unsupported NIfTI header ({first})") from None
    except MemoryError:
        raise DataError(
            f"{path}: not enough memory to read it (lower max_volume_gb to refuse such files early)"
        ) from None
    except (OSError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "truncated file" if "Expected" in first and "bytes" in first else "unreadable"
        raise DataError(f"{path}: {kind} ({first})") from None
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataError(f"{path}: expected a 3D volume, got shape {tuple(data.shape)}")
    zooms = tuple(float(z) for z in img.header.get_zooms()[:3])
    codes = "".join(nib.aff2axcodes(img.affine))
    return VolumeInfo(tuple(data.shape), zooms, codes, img.affine), data


def save_nifti(volume: np.ndarray, affine: np.ndarray, path: str | Path, dtype=np.float32) -> None:
    """Write [C, D, H, W] (C=1 → a 3D file) with the given affine, atomically."""
    array = volume[0] if volume.shape[0] == 1 else np.moveaxis(volume, 0, -1)
    img = nib.Nifti1Image(array.astype(dtype), affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    path = Path(path)
    # the temp name keeps the .nii.gz ending nibabel needs; samples are re-creatable, so no fsync
    atomic_write(path, lambda tmp: nib.save(img, str(tmp)), "the NIfTI file", tmp_name=f".tmp.{path.name}", fsync=False)
