"""specfit.core.kernels.entry_point: the hot kernels handed out without numba's per-call type dispatch."""

import numba
import numpy as np
import pytest

from specfit.core.kernels import (entry_point, frequency_observe_top_k_kernel, frequency_predict_kernel,
                                  item_words_kernel)
from specfit.solvers.exact_compiled import exact_kernel, exact_nodes_kernel, linear_prefix_kernel


@numba.njit(cache=False)
def _scaled_sum(a, w):
    return (a * w).sum()


def test_entry_point_gives_the_dispatchers_results_and_refuses_another_item_size():
    a = np.arange(5.0)
    call = entry_point(_scaled_sum, a, 2.0)
    assert not isinstance(call, numba.core.dispatcher.Dispatcher)  # this numba keeps the entry point
    for x, w in ((a, 2.0), (np.ones(3), 0.5), (np.zeros(0), 1.0), (a, 3)):  # an int where a float64 is expected
        assert call(x, w) == _scaled_sum.py_func(x, w)
    with pytest.raises(TypeError):
        call(np.arange(5, dtype=np.float32), 2.0)  # (a same-size dtype, e.g. int64, would be reinterpreted)
    assert len(_scaled_sum.signatures) == 1  # nothing compiled again by the entry point's calls


@pytest.mark.parametrize("factory", [item_words_kernel, frequency_observe_top_k_kernel, frequency_predict_kernel,
                                     exact_kernel, exact_nodes_kernel, linear_prefix_kernel])
def test_the_hot_kernels_are_entry_points(factory):
    """The kernels a drafted cycle enters several times are compiled entry points, so each call skips
    numba's dispatch; a numba that dropped the entry point would hand out the dispatcher."""
    assert not isinstance(factory(), numba.core.dispatcher.Dispatcher)


def test_entry_point_falls_back_to_the_dispatcher_without_an_overload_entry():
    class Plain:  # a callable without numba's overloads: itself
        def __call__(self, x):
            return x + 1

    plain = Plain()
    assert entry_point(plain, 1) is plain
