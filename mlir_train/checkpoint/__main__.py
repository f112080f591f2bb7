"""``python -m mlir_train.checkpoint verify DIR ...``: check every step's files against its manifest
(files only: no jax backend starts for this)."""

import sys

from mlir_train.checkpoint.integrity import verify_main

sys.exit(verify_main())
