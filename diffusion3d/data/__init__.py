"""Data, one job per module: discovery → validation → transforms → cache → stream.

| module | job |
| --- | --- |
| ``errors`` | ``DataError`` (one line naming the file), ``DataProblems`` (every bad file at once) |
| ``nifti`` | NIfTI in and out: header checks before any voxel is read, ``read_volume``, ``save_nifti`` |
| ``discovery`` | cases from image/mask folders or a CSV manifest; the image-channel count; the hold-out split |
| ``validation`` | every case checked before training (``validate``), ``format_summary`` |
| ``transforms`` | MONAI transforms to the model grid, ``mask_to_cond``, ``MaskGrid`` (the way back) |
| ``cache`` | the transformed training set, decoded once (memory / disk / none) |
| ``stream`` | ``SampleStream`` (sample k depends on (seed, k) only) and the endless loader |

The names below are the package's public interface; import them from ``diffusion3d.data``.
"""

from .cache import build_dataset, data_items, transform_key
from .discovery import Case, case_name, discover, scan_folder, split_cases
from .errors import DataError, DataProblems
from .nifti import NIFTI_SUFFIXES, VolumeInfo, check_header, read_volume, save_nifti
from .stream import SampleStream, make_loader
from .transforms import MaskGrid, mask_to_cond, plain, training_transforms
from .validation import check_case, check_mask_labels, format_summary, max_volume_bytes, validate

__all__ = [
    "NIFTI_SUFFIXES",
    "Case",
    "DataError",
    "DataProblems",
    "MaskGrid",
    "SampleStream",
    "VolumeInfo",
    "build_dataset",
    "case_name",
    "check_case",
    "check_header",
    "check_mask_labels",
    "data_items",
    "discover",
    "format_summary",
    "make_loader",
    "mask_to_cond",
    "max_volume_bytes",
    "plain",
    "read_volume",
    "save_nifti",
    "scan_folder",
    "split_cases",
    "training_transforms",
    "transform_key",
    "validate",
]
