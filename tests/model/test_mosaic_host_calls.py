"""The host side of the interpreted Mosaic-GPU MoE kernels (``--code-paths gpu``): a call whose
kernel program and operands equal a recent call's takes that result; any other call runs."""

import jax
import jax.numpy as jnp
import numpy as np

from mlir_train.model.kernels import mosaic_moe


def _host(fn, *args):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return mosaic_moe._HostKernel(jax.jit(fn), jax.make_jaxpr(fn)(*shapes))


def test_identical_calls_reuse_the_result_and_others_run():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    double, triple = _host(lambda a: a * 2, x), _host(lambda a: a * 3, x)
    before = dict(mosaic_moe.CALLS)
    first = double(x)
    np.testing.assert_array_equal(double(x.copy()), x * 2)  # the same bytes: reused
    first[0, 0] = -1.0  # a caller's copy: the kept result is untouched
    np.testing.assert_array_equal(double(x), x * 2)
    np.testing.assert_array_equal(triple(x), x * 3)  # another program on the same operands runs
    np.testing.assert_array_equal(double(x + 1), (x + 1) * 2)  # other operands run
    np.testing.assert_array_equal(double(x.astype(np.float64).astype(np.float32)), x * 2)
    y = jnp.zeros((3, 2), jnp.float32)  # the same bytes in another shape is another call
    np.testing.assert_array_equal(_host(lambda a: a * 2, y)(np.zeros((3, 2), np.float32)), np.zeros((3, 2)))
    assert mosaic_moe.CALLS["run"] - before["run"] == 4 and mosaic_moe.CALLS["reused"] - before["reused"] == 3
