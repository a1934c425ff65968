"""SpecFit.from_pretrained(..., offload="host") on the shipped proxy: the trace's hot set, same outputs."""

import numpy as np
import pytest

from specfit import SpecFit
from specfit.core.cost import DEFAULT_HOST_PROFILE, DEFAULT_PROFILE, get_host_profile, get_profile
from specfit.core.errors import SpecFitInputError
from specfit.models.proxy import paths
from specfit.models.traces import RoutingTrace

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def proxy():
    p = paths()
    if not (p["target"] / "config.json").is_file() or not (p["target"] / "routing_trace.npz").is_file():
        pytest.skip("the shipped proxy target and trace are not built")
    return p


def test_host_offload_places_the_trace_hot_set_and_decodes_like_transfer(proxy):
    trace = RoutingTrace.load(proxy["target"] / "routing_trace.npz")
    host = SpecFit.from_pretrained(proxy["target"], proxy["eagle3"], cache_slots=16, offload="host")
    transfer = SpecFit.from_pretrained(proxy["target"], proxy["eagle3"], cache_slots=16)
    L = len(host.target.spec.moe_layers)
    assert host.cost == get_host_profile(DEFAULT_HOST_PROFILE).for_layers(L)  # the host objective selects
    assert transfer.cost == get_profile(DEFAULT_PROFILE).for_layers(L)
    for layer, ids in enumerate(host.target.cache.cached_experts()):
        counts = np.bincount(trace.routing[:, layer].ravel(), minlength=trace.num_experts)
        assert len(ids) == 16 and counts[ids].min() >= np.sort(counts)[::-1][15]   # the 16 most frequent
    for method in ("ar", "specfit"):
        a = transfer.generate("Question: 12 + 30 = ?", method=method, max_new_tokens=12)
        b = host.generate("Question: 12 + 30 = ?", method=method, max_new_tokens=12)
        assert a.output_ids == b.output_ids, method
        assert b.stats["total"]["bytes_moved"] == 0 and b.stats["total"]["host_computed"] > 0
        assert all(len(c.host["computed"]) == len(host.target.spec.moe_layers) for c in b.cycles)
        assert all(c.host == {} for c in a.cycles)


def test_bad_offload_is_refused_before_loading(proxy):
    with pytest.raises(SpecFitInputError, match="offload"):
        SpecFit.from_pretrained(proxy["target"], offload="cpu")
