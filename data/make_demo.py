"""Generate a small synthetic demo dataset of (mask, MRI-like image) pairs.

Each case is a 32^3 volume at 1.5 mm isotropic spacing (RAS, centred origin):

* ``masks/case_XXX.nii.gz`` (uint8): 0 background, 1 head-like ellipsoid,
  2 a small lesion ellipsoid lying fully inside the head.
* ``images/case_XXX.nii.gz`` (float32 in [0, 1]): intensity follows the mask
  (background ~0.02, tissue ~0.5, lesion ~0.9) plus a bright skull rim,
  a smooth low-frequency texture inside the head and small Gaussian noise.

Generation is deterministic: every case has its own numpy Generator seeded
from (seed, case index), and gzip is written with mtime=0, so reruns are
byte-identical. Regenerate with::

    python data/make_demo.py [--seed 0] [--n 20] [--size 32] [--out data/demo]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from diffusion3d.synthetic import SPACING, make_case, save


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "demo")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--size", type=int, default=32)
    args = p.parse_args()
    (args.out / "images").mkdir(parents=True, exist_ok=True)
    (args.out / "masks").mkdir(parents=True, exist_ok=True)
    for i in range(args.n):
        mask, image = make_case(np.random.default_rng([args.seed, i]), args.size)
        save(mask, args.out / "masks" / f"case_{i:03d}.nii.gz")
        save(image, args.out / "images" / f"case_{i:03d}.nii.gz")
    print(f"wrote {args.n} image/mask pairs ({args.size}^3, {SPACING} mm) to {args.out}")


if __name__ == "__main__":
    main()
