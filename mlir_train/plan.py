"""``python -m mlir_train.plan``: will this layout fit, and how fast would it be (:mod:`mlir_train.planner.plan`).
A bad flag ends it with one ``mlir-train: error:`` line and exit status 2, as every entry point."""

if __name__ == "__main__":
    from mlir_train.planner.plan import main
    from mlir_train.runtime.errors import exit_on_user_error

    with exit_on_user_error():
        main()
