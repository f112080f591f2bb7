"""Rewrite README.md's flag table (between the flag-table markers) from mlir_train.config.flag_table.

    python scripts/update_flag_table.py

tests/config/test_flags.py fails when the README's table and the flags disagree; this is the fix.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mlir_train, not an installed one

from mlir_train.config.flag_table import flag_table_markdown  # noqa: E402

BEGIN, END = "<!-- flag-table:begin -->\n", "<!-- flag-table:end -->"


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    table = flag_table_markdown().rstrip("\n") + "\n"
    readme.write_text(head + BEGIN + table + END + tail)
    print(f"wrote {readme}")


if __name__ == "__main__":
    main()
