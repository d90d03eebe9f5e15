"""The HF reference of :mod:`launch.bench.layers`: the transformers text model that makes the
weights (copied into ours), and its fwd+bwd step (``hf_bs1`` / ``hf_bs4``)."""
from __future__ import annotations

from launch.bench._layers_timing import _alloc_gib, _backward, _peak_gib, _time_steps, bench_loss


def _hf_classes():
    import transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe as m

    model_cls = m.Qwen3OmniMoeThinkerTextModel
    return model_cls.config_class, model_cls


def build_hf(cfg: dict, device, dtype, seed: int):
    """(HF text model, which attention / experts implementation it runs)."""
    import torch

    cfg_cls, model_cls = _hf_classes()
    tc = dict(cfg["thinker_config"]["text_config"])
    tc.pop("model_type", None)
    hf_cfg = cfg_cls(**tc)
    torch.manual_seed(seed)
    impl = {}
    for kw in ({"attn_implementation": "sdpa", "experts_implementation": "grouped_mm"},
               {"attn_implementation": "sdpa"}):
        try:
            with torch.device(device):
                model = model_cls._from_config(hf_cfg, dtype=dtype, **kw)
            break
        except (TypeError, ValueError) as e:  # an older transformers without experts_implementation
            impl["note"] = f"{type(e).__name__}: {e}"
    c = model.config
    impl["attn_implementation"] = getattr(c, "_attn_implementation", None)
    impl["experts_implementation"] = getattr(c, "_experts_implementation", None)
    return model.train(), impl


def hf_state_as_checkpoint(model, hidden: int, ffn: int) -> dict:
    """The HF text model's tensors (CPU) under the checkpoint's per-expert names (``thinker.model.*``).

    transformers 5.x holds a layer's experts fused: ``gate_up_proj [E, 2F, h]`` (gate rows first)
    and ``down_proj [E, h, F]``; a transposed layout (``[E, h, 2F]`` / ``[E, F, h]``) is recognised by
    its shape."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        if name.endswith("mlp.experts.gate_up_proj"):
            if tuple(t.shape[1:]) == (hidden, 2 * ffn) and hidden != 2 * ffn:
                t = t.transpose(1, 2)
            base = "thinker.model." + name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :ffn].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, ffn:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            if tuple(t.shape[1:]) == (ffn, hidden) and ffn != hidden:
                t = t.transpose(1, 2)
            base = "thinker.model." + name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out["thinker.model." + name] = t
    return out


def run_hf(model, ids: list, probe, device, batch: int, warmup: int, iters: int, keep_output: bool) -> dict:
    import torch

    lens = [int(x.numel()) for x in ids]
    starts = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    groups = [list(range(i, min(i + batch, len(ids)))) for i in range(0, len(ids), batch)]
    padded = 0
    for grp in groups:
        padded += max(lens[i] for i in grp) * len(grp)

    probe_lo = probe.to(next(model.parameters()).dtype)

    def step(keep=False, trace=None):
        outs = {}  # the gradients are dropped at the end of the step, as ours (_layers_ours.py)
        for grp in groups:
            a = _alloc_gib(device) if trace is not None else None
            L = max(lens[i] for i in grp)
            inp = torch.zeros(len(grp), L, dtype=torch.long, device=device)
            mask = torch.zeros(len(grp), L, dtype=torch.long, device=device)
            pr = torch.zeros(len(grp), L, probe.shape[1], dtype=probe_lo.dtype, device=device)
            for j, i in enumerate(grp):
                inp[j, :lens[i]] = ids[i]
                mask[j, :lens[i]] = 1
                pr[j, :lens[i]] = probe_lo[starts[i]:starts[i + 1]]
            kw = {} if len(grp) == 1 else {"attention_mask": mask}
            out = model(input_ids=inp, use_cache=False, **kw).last_hidden_state
            loss = bench_loss(out, pr)
            _backward(loss, device, trace, sum(lens[i] for i in grp), a)
            if keep:
                for j, i in enumerate(grp):
                    outs[i] = out[j, :lens[i]].detach()
        model.zero_grad(set_to_none=True)
        return outs

    first = step(keep=keep_output)
    pipelined = []
    times = _time_steps(step, device, warmup, iters, pipelined_s=pipelined)
    res = {"step_s": times, "output": torch.cat([first[i] for i in range(len(ids))]) if keep_output else None,
           "padded_tokens": padded, "peak_gib": _peak_gib(device), "step_s_pipelined": pipelined[0]}
    if device.type == "cuda":  # after the peak was read: this resets it
        res["memory_trace"] = []
        step(trace=res["memory_trace"])
    return res
