"""Train a conditional 3D diffusion model: ``python train.py --with_condition --accum 2``."""

from diffusion3d.commands.train import main

if __name__ == "__main__":
    main()
