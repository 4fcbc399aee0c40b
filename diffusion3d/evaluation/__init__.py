"""Evaluation library: metrics, pairing of inputs, per-image scores, the HTML report, downstream
segmentation Dice and FID/MMD on MedicalNet features. The ``evaluate`` command calls it."""
