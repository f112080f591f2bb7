"""``python -m mlir_train.plan``: will this layout fit, and how fast would it be (:mod:`mlir_train.planner.plan`)."""

if __name__ == "__main__":
    from mlir_train.planner.plan import main

    main()
