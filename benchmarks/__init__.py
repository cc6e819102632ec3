"""Benchmarks of tf_gba, each run as `python -m benchmarks.<name>` (see the README)."""

import os

# TensorFlow's start-up notices (CPU features, oneDNN, no CUDA driver) are not results: keep them
# off the terminal unless the user asked for TF's log level, as the training binary does.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
