"""``python -m mlir_train.checkpoint verify DIR``: check every step's files against its manifest."""

import sys

from mlir_train.runtime.platform_setup import configure_platform

configure_platform()  # before jax is imported

from mlir_train.checkpoint.orbax import verify_main  # noqa: E402

sys.exit(verify_main())
