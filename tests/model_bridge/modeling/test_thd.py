"""``thd_params``: packed-sequence parameters whose host offsets ride along, so the thinker plans a
packed pass without reading device tensors (no host syncs: the host can queue the next
micro-batch while the GPU works). CPU: the plan comes from the host copy; GPU: a whole packed
forward + backward of the thinker makes no host sync at all.
"""
from __future__ import annotations

import pytest
import torch

from model_bridge.spawn import run_ranks
from model_bridge.modeling.thd import host_offsets, offsets_to_device, thd_params, to_device_async


def test_thd_params_carry_host_offsets():
    psp = thd_params([0, 3, 7, 12], "cpu")
    assert psp.qkv_format == "thd" and psp.max_seqlen_q == 5 and psp.max_seqlen_kv == 5
    assert psp.cu_seqlens_q is psp.cu_seqlens_kv and psp.cu_seqlens_q.dtype == torch.int32
    assert psp.cu_seqlens_q.tolist() == [0, 3, 7, 12]
    assert host_offsets(psp) == ((0, 3, 7, 12), None)
    psp.cu_seqlens_kv = psp.cu_seqlens_q.clone()  # someone swapped the tensors: the copy no longer holds
    assert host_offsets(psp) is None
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0, got \[0, 5, 3\]"):
        thd_params([0, 5, 3], "cpu")
    assert to_device_async(torch.arange(3), "cpu").tolist() == [0, 1, 2]


def test_deferred_copy_leaves_the_offsets_on_the_host():
    """``defer_copy`` for a CUDA device (no CUDA needed to build it): the int32 offsets stay a CPU
    tensor marked for that device, host copy attached; for a CPU device it changes nothing, and
    :func:`offsets_to_device` hands back anything not deferred as it is."""
    psp = thd_params([0, 3, 7, 12], "cuda", defer_copy=True)
    assert psp.cu_seqlens_q.device.type == "cpu" and psp.cu_seqlens_q.dtype == torch.int32
    assert psp.cu_seqlens_q.tolist() == [0, 3, 7, 12] and psp.cu_seqlens_kv is psp.cu_seqlens_q
    assert host_offsets(psp) == ((0, 3, 7, 12), None) and psp._mgrpo_offsets_for == torch.device("cuda")
    plain = thd_params([0, 3, 7, 12], "cpu", defer_copy=True)
    assert not hasattr(plain, "_mgrpo_offsets_for") and offsets_to_device(plain) is plain


def test_plans_come_from_the_host_copy():
    """The varlen plan and the trailing-padding fix read the host offsets, never the device tensor:
    scribbling over the device tensor after ``thd_params`` changes neither."""
    from model_bridge.modeling.thinker import _normalize_packed
    from model_bridge.modeling.attention import varlen_plan

    psp = thd_params([0, 3, 7], "cpu")
    psp.cu_seqlens_q[1] = 6  # not what the packer said; a device read would see it
    norm = _normalize_packed(psp, 10)  # 3 trailing padding tokens
    assert host_offsets(norm) == ((0, 3, 7), (0, 3, 10))
    assert norm.cu_seqlens_q_padded.tolist() == [0, 3, 10]  # megatron's own THD code gets them from the host too
    plan = varlen_plan(norm, 10, torch.device("cpu"))
    # the plan's numbers come from the host; its device offsets are the packer's own tensor (the
    # varlen offsets of the gathered samples are the unpadded ones: no second copy to the device)
    assert plan.n_real == 7 and plan.max_len == 4 and plan.idx is None and plan.cu is psp.cu_seqlens_q
    with_gap = _normalize_packed(thd_params([0, 3, 7], "cpu"), 10)
    with_gap.cu_seqlens_q_padded = torch.tensor([0, 4, 10], dtype=torch.int32)  # a gap after sample 0
    from model_bridge.modeling.thd import attach_host_offsets

    attach_host_offsets(with_gap, (0, 3, 7), (0, 4, 10))
    gplan = varlen_plan(with_gap, 10, torch.device("cpu"))
    # with gaps the samples are gathered together first: their offsets are still the unpadded ones
    assert gplan.cu is with_gap.cu_seqlens_q and gplan.idx.tolist() == [0, 1, 2, 4, 5, 6, 7]


def _rank_no_syncs(hf_dir: str) -> dict:
    import warnings

    from model_bridge.config import ParallelLayout, read_omni_config
    from model_bridge.load import load_hf
    from model_bridge.modeling.thinker import build_thinker, mrope_position_ids
    from model_bridge.parallel import destroy_parallel, init_parallel

    init_parallel(seed=1)
    spec = read_omni_config(hf_dir)
    model = build_thinker(spec, ParallelLayout(), torch.bfloat16, backend="torch", dummy_audio=False).cuda()
    load_hf(model, hf_dir)
    g = torch.Generator().manual_seed(0)
    lens = [37, 90, 21]
    cu = [0, 37, 127, 148]
    ids = torch.randint(0, 400, (1, 150), generator=g)
    pos = mrope_position_ids(ids, spec, cu_seqlens=torch.tensor(cu)).unsqueeze(1).cuda()
    ids = ids.cuda()
    n_audio = 0
    res, outs = {}, {}
    # the offsets copied by thd_params, then left on the host for the thinker (defer_copy)
    for attempt, defer in (("warm-up", False), ("measured", False), ("measured_deferred", True)):
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            try:
                psp = thd_params(cu, "cuda", max(lens), defer_copy=defer)
                out = model(ids, pos, psp, audio_token_count=n_audio)
                out.float().square().mean().backward()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        res[attempt] = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
        outs[attempt] = out.detach()
    torch.cuda.synchronize()
    res["finite"] = bool(torch.isfinite(out.float()).all())
    res["deferred_equal"] = torch.equal(outs["measured"], outs["measured_deferred"])
    # a spec that does not take host offsets gets them on the device (thd.offsets_to_device)
    local = build_thinker(spec, ParallelLayout(), torch.bfloat16, backend="local", dummy_audio=False).cuda()
    load_hf(local, hf_dir)
    with torch.no_grad():
        copied, deferred = (local(ids, pos, thd_params(cu, "cuda", max(lens), defer_copy=d), audio_token_count=0)
                            for d in (False, True))
        res["local_deferred_equal"] = torch.equal(copied, deferred)
    destroy_parallel()
    return res


@pytest.mark.gpu
def test_packed_forward_backward_makes_no_host_sync(tiny_ckpt):
    """With ``thd_params`` and the host audio count, a packed bf16 forward + backward of the thinker
    on the torch backend (varlen attention, grouped experts, device expert counts) issues no
    synchronizing CUDA call (torch's sync debug mode), with the offsets on the device or left on
    the host (``defer_copy``: the same output); the local spec gets deferred offsets moved."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    res = run_ranks(_rank_no_syncs, 1, str(tiny_ckpt), timeout=600)[0]
    print(f"\n[no host syncs] {res}")
    assert res["finite"] and res["deferred_equal"] and res["local_deferred_equal"], res
    assert res["measured"] == [] and res["measured_deferred"] == [], res
