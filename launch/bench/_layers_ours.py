"""Our thinker in :mod:`launch.bench.layers`: building it with given weights, packed THD
micro-batches, the fwd+bwd step (``ours``, ``ours_mb``, ``mcore_local``) and the probe losses."""
from __future__ import annotations

import contextlib
import os
import statistics

from launch.bench._layers_timing import (_alloc_gib, _backward, _count_syncs, _peak_gib, _profile, _time_steps, bench_loss,
                                         step_diagnostics)


OUR_SYSTEMS = {
    "ours": ("torch", False, "none", True, False),
    "ours_rc": ("torch", False, "experts", True, False),
    "ours_mb": ("torch", True, "none", True, False),
    "ours_mb_rc": ("torch", True, "experts", True, False),
    "ours_full_rc": ("torch", False, "full", True, False),
    "ours_sepqkn": ("torch", False, "none", False, False),
    "ours_mb_sepqkn": ("torch", True, "none", False, False),
    "ours_graph": ("torch", False, "none", True, True),
    "ours_mb_graph": ("torch", True, "none", True, True),
    "mcore_local": ("local", False, "none", False, False),
}
"""Megatron systems of the bench: name -> (layer-spec backend, micro-batches of ``--mb-tokens``
(else the whole batch in one), ``build_thinker``'s ``recompute``, q/k RMSNorm fused into the RoPE
kernel (the default; ``MGRPO_TRITON_QK_NORM_ROPE`` is set to 1 or 0 while the system runs,
modeling/rope.py), the whole step captured once as a CUDA graph and replayed (CUDA only;
:func:`run_ours`'s ``graph``))."""


@contextlib.contextmanager
def graph_stream(device):
    """A fresh CUDA stream made current for a graph system's whole life (model build to its last
    step). Its parameters' gradient accumulation (autograd's ``AccumulateGrad``) then runs on that
    stream too, which a capture needs: on the legacy default stream it would make the capture fail
    (``operation would make the legacy stream depend on a capturing blocking stream``). Elsewhere
    (CPU) nothing changes."""
    import torch

    if device.type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(device)):
        yield


@contextlib.contextmanager
def qk_norm_rope_env(on: bool):
    """``MGRPO_TRITON_QK_NORM_ROPE`` set to ``on`` for one system's run (read at every forward)."""
    key = "MGRPO_TRITON_QK_NORM_ROPE"
    prev = os.environ.get(key)
    os.environ[key] = "1" if on else "0"
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = prev


def build_megatron(spec, ep: int, backend: str, dtype, device, tensors: dict, recompute: str = "none"):
    """Our thinker (embedding + decoder, no output layer, no audio tower) with ``tensors``' weights."""
    import torch

    from model_bridge.config import ParallelLayout
    from model_bridge.mappings import DictSource, ParallelContext, build_tasks
    from model_bridge.modeling.thinker import build_thinker
    from model_bridge.qwen3_omni import mapping_rules

    on_cuda = device.type == "cuda"
    model = build_thinker(spec, ParallelLayout(ep=ep), dtype, post_process=False, backend=backend,
                          dummy_audio=False, build_audio=False, perform_initialization=False, recompute=recompute,
                          use_cpu_initialization=not on_cuda)
    model = model.to(device)
    src = DictSource(tensors)
    ctx = ParallelContext.from_parallel_state()
    with torch.no_grad():
        for t in build_tasks(model, mapping_rules(spec, 1), ctx):
            t.param.data.copy_(t.mapping.load(src, t.hf, t.param.shape, t.shard).to(device, t.param.dtype))
    return model.train()


def _rms_norm(x, w, eps: float = 1e-6):
    """The final RMSNorm as our model runs it (``FastRMSNorm``'s kernels on CUDA: ``norm.rms_norm``),
    so the final norm costs every system what it costs in training."""
    from model_bridge.modeling.norm import rms_norm

    return rms_norm(x, w, eps)


def _micro_batches(spec, ids: list, probe, device, groups: list[list[int]] | None = None) -> list[tuple]:
    """``(sample indices, lengths, (host cu_seqlens, audio tokens), tokens [1, T], MRoPE positions,
    probe row indices or None for all)`` per micro-batch (``groups``: sample indices per micro-batch; default one micro-batch of all)."""
    import torch

    from model_bridge.modeling.thinker import mrope_position_ids

    lens_all = [int(x.numel()) for x in ids]
    starts = [0] + list(torch.tensor(lens_all).cumsum(0).tolist())
    mbs = []
    for grp in groups or [list(range(len(ids)))]:
        lens = [lens_all[i] for i in grp]
        cu = [0] + list(torch.tensor(lens).cumsum(0).tolist())  # host offsets, as a packer has them
        tokens = torch.cat([ids[i] for i in grp]).unsqueeze(0)
        pos = mrope_position_ids(tokens, spec, cu_seqlens=torch.tensor(cu)).unsqueeze(1).to(device)
        # the micro-batch's probe rows are gathered in the step (as HF's runs build theirs), not kept
        rows = None if grp == list(range(len(ids))) else torch.cat(
            [torch.arange(starts[i], starts[i + 1]) for i in grp]).to(device)
        n_audio = int((tokens == spec.audio_token_id).sum())  # counted once here, as the trainer counts on the host
        mbs.append((grp, lens, (cu, n_audio), tokens, pos, rows))
    return mbs


def _forward_mb(model, mb: tuple, norm_w, psp=None):
    """Final-normed hidden states ``[T, h]`` of one micro-batch from :func:`_micro_batches`: its
    ``PackedSeqParams`` made per step from the host offsets (``thd_params``: no host sync), as
    the trainer's forward step does; or ``psp``, made once (a CUDA graph replays the addresses its
    capture saw, so its offsets must already be on the device)."""
    from model_bridge.modeling.thd import thd_params

    _, lens, (cu, n_audio), tokens, pos, _ = mb
    if psp is None:
        psp = thd_params(cu, tokens.device, max(lens), defer_copy=True)  # the thinker copies them (thd.py)
    hidden = model(tokens, pos, psp, audio_token_count=n_audio)  # [T, 1, h]
    return _rms_norm(hidden.squeeze(1), norm_w)  # a view (``hidden[:, 0]``'s backward zero-fills and copies)


def probe_losses(model, spec, ids: list, probe, norm_w, device) -> dict:
    """Forward only (training mode, no grad) of the whole batch as one micro-batch: the bench's loss
    ``sum(out * R)``, its scale ``sum(|out * R|)`` and ``sum(out^2)`` (fp32 sums, Python floats).
    The EP-N run compares these per rank with the EP1 model's on the same tokens."""
    import torch

    (mb,) = _micro_batches(spec, ids, probe, device)
    with torch.no_grad():
        out = _forward_mb(model, mb, norm_w).float()
        lo = out * probe.float()
        return {"loss": lo.sum().item(), "loss_scale": lo.abs().sum().item(), "sumsq": out.pow(2).sum().item()}


def run_ours(model, spec, ids: list, probe, norm_w, device, warmup: int, iters: int, profile_path=None,
             capture_counts: bool = False, groups: list[list[int]] | None = None, barrier=None,
             keep_step: bool = False, diagnose: bool = False, graph: bool = False) -> dict:
    """fwd+bwd of the packed batch (``groups``: micro-batches of sample indices, grads accumulated).

    Every rank of an EP run must call this with the same arguments apart from the data (same
    warmup/iters, ``profile_path`` given on all ranks or on none): each step is collective.
    ``barrier`` (a callable) lines the ranks up before the timed steps. ``keep_step``: the result's
    ``"step"`` is the step function (the kernel ceiling times it again, taking turns with its own).
    ``diagnose`` (CUDA, one rank): also ``step_s_gpu_bound`` and ``step_s_after_idle``
    (:func:`~launch.bench._layers_timing.step_diagnostics`). ``graph`` (CUDA, inside
    :func:`graph_stream`): the timed step is the replay of one CUDA graph of the whole step
    (:func:`_graph_step`, whose checks against the eager step go into the result)."""
    import torch

    mbs = _micro_batches(spec, ids, probe, device, groups)
    dtype = next(model.parameters()).dtype
    probes_lo = [(probe if mb[5] is None else probe.index_select(0, mb[5])).to(dtype) for mb in mbs]
    counts = []
    hooks = []
    if capture_counts:
        from model_bridge.modeling.experts import TorchGroupedMLP

        def hook(mod, args):
            counts.append([int(v) for v in torch.as_tensor(args[1]).tolist()])

        for m in model.modules():
            if isinstance(m, TorchGroupedMLP):
                hooks.append(m.register_forward_pre_hook(hook))

    psps = None
    if graph:
        from model_bridge.modeling.thd import thd_params

        psps = [thd_params(mb[2][0], device, max(mb[1])) for mb in mbs]

    def body(outs=None, trace=None):
        # fwd+bwd of every micro-batch, gradients accumulated; ``outs``: sample index -> its rows
        for k, (mb, pr) in enumerate(zip(mbs, probes_lo)):
            grp, lens = mb[0], mb[1]
            a = _alloc_gib(device) if trace is not None else None
            out = _forward_mb(model, mb, norm_w, None if psps is None else psps[k])
            loss = bench_loss(out, pr)
            _backward(loss, device, trace, sum(lens), a)
            if outs is not None:
                off = 0
                for i, n in zip(grp, lens):
                    outs[i] = out[off:off + n].detach()
                    off += n

    def step(keep=False, trace=None):
        # the gradients are dropped at the end of the step (below), not here: freeing them is host
        # work, which here would sit in the prologue while the GPU waits (same for HF's systems)
        outs = {} if keep else None
        body(outs, trace)
        model.zero_grad(set_to_none=True)
        norm_w.grad = None
        return torch.cat([outs[i] for i in range(len(ids))]) if keep else None

    first = step(keep=True)
    for h in hooks:
        h.remove()
    checks = {}
    if graph:
        step, checks = _graph_step(body, first, [*model.parameters(), norm_w], len(ids))
    if barrier is not None:
        barrier()
    host, pipelined = [], []
    times = _time_steps(step, device, warmup, iters, host_s=host, pipelined_s=pipelined)
    res = {"step_s": times, "host_issue_s": host, "step_s_pipelined": pipelined[0], "output": first, "expert_counts": counts,
           "micro_batch_tokens": [sum(m[1]) for m in mbs], "peak_gib": _peak_gib(device), **checks}
    if diagnose and device.type == "cuda":  # after the peak was read (same memory, but kept apart)
        res.update(step_diagnostics(step, device, iters, statistics.median(host)))
    if device.type == "cuda" and not graph:  # after the peak was read: this resets it
        res["memory_trace"] = []
        step(trace=res["memory_trace"])
    if profile_path is not None and device.type == "cuda" and not graph:
        res["profile"] = _profile(step, profile_path)
        res["host_syncs"] = _count_syncs(step)
    if keep_step:
        res["step"] = step
    return res


def _grads(params) -> list:
    """The parameters' gradients as fp32 host copies (kept off the GPU: not in the peak memory)."""
    import torch

    return [None if p.grad is None else p.grad.detach().to("cpu", torch.float32) for p in params]


def _max_rel_diff(a: list, b: list) -> float:
    """Largest ``|x - y| / |y|`` (Frobenius norms) over pairs of gradients; inf where one is missing."""
    worst = 0.0
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, ((x - y).norm() / y.norm().clamp_min(1e-30)).item())
    return worst


def _graph_step(body, eager_out, params: list, n_samples: int):
    """``(replay, checks)``: ``body`` (the whole step's fwd+bwd) captured once as a CUDA graph on
    the current stream (:func:`graph_stream`), and what the replay was checked against:

    * ``graph_output_equals_eager``: the replay's final hidden states equal the eager step's
      (``eager_out``) bit for bit (the forward has no atomics: a replay that read a stale host
      copy or a freed buffer would differ);
    * ``graph_grad_rel_diff_vs_eager``: the replay's gradients against an eager step's (largest
      relative difference over the parameters), next to ``eager_grad_rel_diff_run_to_run``, two
      eager steps against each other (the backward's atomics: flash attention's dq, the
      probabilities' index_add).

    The gradients stay in the graph's memory: the first micro-batch's backward writes them, the
    later ones add to them, every replay the same (nothing may set them to None in between).
    ``replay(keep=False, trace=None)`` takes ``step``'s arguments and ignores them."""
    import torch

    ref = []
    for _ in range(2):  # two eager steps' gradients: the run-to-run spread (and the capture's warm-up)
        body()
        ref.append(_grads(params))
        for p in params:  # the capture starts with no gradients: its first backward writes them
            p.grad = None
    static = {}
    # the peak from here on: what the captured step holds (weights, gradients, its activations in
    # the graph's memory pool), as the eager systems' peak is what their step holds
    torch.cuda.reset_peak_memory_stats()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.current_stream()):
        body(static)
    g.replay()
    torch.cuda.current_stream().synchronize()
    out = torch.cat([static[i] for i in range(n_samples)])
    checks = {"graph_output_equals_eager": bool(torch.equal(out, eager_out)),
              "graph_grad_rel_diff_vs_eager": _max_rel_diff(_grads(params), ref[0]),
              "eager_grad_rel_diff_run_to_run": _max_rel_diff(ref[1], ref[0])}

    def replay(keep=False, trace=None):
        g.replay()

    return replay, checks
