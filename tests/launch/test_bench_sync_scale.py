"""`mgrpo bench sync --senders N` (launch/bench/sync_scale.py): the push-time model's inputs agree
with the release's geometry and its target holds; the measured run's senders each send exactly
their share through the product's gloo p2p calls."""
from __future__ import annotations

import pytest

from launch.bench.sync_scale import Recipe30B, model_table, push_time_model, run_senders


def test_model_inputs_match_the_geometry_and_the_target_holds():
    r = Recipe30B()
    experts_gb = 128 * 48 * 3 * 768 * 2048 * 2 / 1e9  # experts x layers x (gate, up, down) x bf16
    assert r.expert_gb == pytest.approx(experts_gb, abs=0.01)
    assert r.total_gb == pytest.approx(61.07, abs=0.01)  # the text thinker bench sync pushes
    g = [push_time_model(n, "gather")["seconds"] for n in (1, 2, 4, 8)]
    m = [push_time_model(n, "multisource")["seconds"] for n in (1, 2, 4, 8)]
    assert g == sorted(g) and m == sorted(m, reverse=True)  # gather gets worse with nodes, multisource better
    assert m[2] <= 1.0 < g[2]
    # 4 nodes, multisource: the inference GPUs' quarter of the weights is the busiest link
    assert push_time_model(4, "multisource")["busiest_link_gb"] == pytest.approx(r.total_gb / 4)
    assert model_table().count("\n") == 5
    with pytest.raises(ValueError, match="gather or multisource"):
        push_time_model(4, "broadcast")


@pytest.mark.slow  # 3 processes: ~10 s on 2 idle cores
def test_senders_each_send_their_share():
    res = run_senders(2, payload_mb=2, bucket_mb=0.25, iters=1, warmup=0, timeout_s=120, baseline=False)
    assert list(res) == [2] and res[2]["sent_bytes"] == [4 * 2**18, 4 * 2**18]
    assert all(v["payload_bytes"] == 2 * 2**20 and v["seconds"] > 0 for v in res.values())
