"""The evaluation metrics, under the name training code imported them by (tf_gba.common.metrics)."""

from tf_gba.common.metrics import auc, evaluate_binary, logloss  # noqa: F401
