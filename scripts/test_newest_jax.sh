#!/usr/bin/env bash
# The newest-jax test lane: the project on Python >= 3.12 with the newest jax, flax and tokamax that
# pyproject admits (jax 0.12.1, flax 0.12.12, tokamax 0.0.17 today) and the CUDA 13 deviceless compiler, on CPU,
# running the default suite there (README, "Supported versions"). The default lane
# (README's test command, jax 0.10.2 on Python 3.11) is the other end of the supported range.
#
#   bash scripts/test_newest_jax.sh            # the lane: every test not marked slow (about 16 minutes on 2 cores, cold)
#   bash scripts/test_newest_jax.sh tests/X.py # pytest arguments added (a file, -k ...)
#
# The interpreter: $PY313 if set, else a Python 3.13 on this machine (pyenv's, or one built before), else
# one built from Debian's source package by ../shared/tools/python3.13.sh (root, about 12 minutes, once per
# machine). The venv is .venv-newest (kept between runs; `rm -r .venv-newest` to start over).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    if [ -n "${PY313:-}" ]; then echo "$PY313"; return; fi
    for p in /opt/python3.13/bin/python3.13 "${HOME:-/root}"/.pyenv/versions/3.13*/bin/python3.13 "$(command -v python3.13 || true)"; do
        if [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import ssl, sqlite3, ctypes, lzma, bz2' 2>/dev/null; then echo "$p"; return; fi
    done
    for tool in ../shared/tools/python3.13.sh shared/tools/python3.13.sh; do
        if [ -f "$tool" ]; then bash "$tool" | tail -1; return; fi
    done
    echo "no Python 3.13 here and no shared/tools/python3.13.sh to build one: set PY313" >&2
    return 1
}

PY=$(find_python)
echo "newest-jax lane: $("$PY" --version) at $PY"
if [ ! -x .venv-newest/bin/python ]; then
    "$PY" -m venv .venv-newest
fi
. .venv-newest/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
python - <<'EOF'
from importlib import metadata
print("newest-jax lane:", ", ".join(f"{p} {metadata.version(p)}" for p in ("jax", "jaxlib", "flax", "tokamax", "jax-cuda13-plugin")))
EOF

# The lane's tests: the whole default suite on this stack (about 16 minutes on 2 cores, cold), and the slow tests
# marked newest_lane (GPU-path layouts the reworked Mosaic-GPU interpreter runs fast here). Tests that need
# torch (HF / megatron-core / peft references) skip here: the default lane runs them.
exec python -m pytest -q -m "not slow or newest_lane" "$@"
