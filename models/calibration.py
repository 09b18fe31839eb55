"""Activation calibration (placeholder until `numaserve calibrate` lands): no file, no calibration."""


def load_calibration(model_dir) -> dict | None:
    return None
