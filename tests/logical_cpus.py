"""Several logical CPU devices for the in-process MirroredStrategy tests (DTS, the contract).

Logical devices must be configured before TensorFlow initialises them, i.e. when the test module
is collected; these tests run in a pytest process of their own (see the Makefile) so that it is
the first thing to touch TensorFlow's devices.
"""

import os

import tensorflow as tf


def configure(count: int) -> None:
  """Splits the CPU into `count` logical devices, unless something configured them already, and
  never in a cluster worker process (TF_CONFIG)."""
  if "TF_CONFIG" in os.environ:
    return
  cpu = tf.config.list_physical_devices("CPU")[0]
  if tf.config.get_logical_device_configuration(cpu) is None:
    try:
      tf.config.set_logical_device_configuration(
          cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    except RuntimeError:
      pass  # TensorFlow is initialised already: the tests that need more devices say so
