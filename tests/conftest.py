"""Shared test setup: quiet TensorFlow logs, Keras 2, and paths to the shared real data."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tf_gba  # noqa: E402,F401  (sets TF_USE_LEGACY_KERAS before TensorFlow is imported)
