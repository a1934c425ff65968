"""The host expert benchmark: the expert it times is the runtime's SwiGLU; its result renders."""

import torch
import torch.nn.functional as F

from specfit.eval.host_bench import bench_dtype, format_table, make_experts, run_experts


def test_run_experts_is_the_sum_of_swiglu_experts():
    gu, dn = make_experts(3, torch.float32, hidden=8, intermediate=4)
    x = torch.randn(5, 8)
    want = sum(F.linear(F.silu(F.linear(x, gu[e][:4])) * F.linear(x, gu[e][4:]), dn[e]) for e in range(3))
    torch.testing.assert_close(run_experts(x, gu, dn), want)


def test_bench_fits_every_point_and_renders():
    res = bench_dtype(torch.float32, repeats=1, tokens=(1, 2), batches=(1, 2), hidden=16, intermediate=8)
    assert [(r["experts"], r["tokens"]) for r in res["rows"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert res["expert_bytes"] == 3 * 16 * 8 * 4
    assert set(res["fit"]) == {"fixed_ms", "per_expert_ms", "per_row_ms", "rel_residual"}
    text = format_table({"dtypes": [res], "bandwidth": {"bytes": 10**9, "ms": 100.0, "copy_gb_per_s": 10.0,
                                                         "read_write_gb_per_s": 20.0}})
    assert "| float32 | 2 |" in text and "10.00 GB/s copied" in text
