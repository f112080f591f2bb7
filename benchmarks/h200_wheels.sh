#!/bin/sh
# The wheels the H200 machine lacks for the tokamax rows (and tensorboardX, which mlir-train imports),
# downloaded here for its Python 3.12 / x86-64 into .whl/ (gitignored), to travel with `run`'s carry.
# Its own jax 0.11.2 / jaxlib / CUDA 13 plugin, flax, optax, numpy, absl-py, jaxtyping, tqdm and
# typing-extensions are used as they are (/work/.library/device/KINDS.md). benchmarks/README.md has the call.
set -e
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  tokamax==0.0.12 einshape==1.0 qwix==0.1.8 typeguard==2.13.3 immutabledict==4.3.1 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tensorboardX==2.6.5
ls -l .whl
