"""``python -m mlir_train.plan``: will this layout fit, and how fast would it be (:mod:`mlir_train.planner.plan`).
Exit status: 0 it fits, 3 it does not (with ``--search``: no layout does), 2 with one
``mlir-train: error:`` line for a layout that cannot exist or a bad flag, as every entry point."""

if __name__ == "__main__":
    import sys

    from mlir_train.planner.plan import exit_status

    sys.exit(exit_status())
