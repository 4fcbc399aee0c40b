"""diffusion3d: conditional 3D diffusion models for volumetric medical images (mask → MRI volume)."""

__version__ = "0.1.0"
