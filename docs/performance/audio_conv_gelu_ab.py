"""A/B of the fused audio conv passes: 70933ac's libdevice-erf GELU (saved as
model_bridge/modeling/acf_old.py: git show 70933ac:model_bridge/modeling/audio_conv_fused.py) against the
checkout's, per call at 500 chunks on CUDA; run from the repository root: python3 docs/performance/audio_conv_gelu_ab.py"""
import importlib, json, sys, torch
from _front_end_inputs import cuda_ms, front_end_inputs
dev = "cuda"
mods = {"old": importlib.import_module("model_bridge.modeling.acf_old"),
        "new": importlib.import_module("model_bridge.modeling.audio_conv_fused")}
K = 500
x, w, b, y2, g1, g2 = front_end_inputs(K)
t = cuda_ms

res, outs = {}, {}
for rnd in range(2):
    for name, m in mods.items():
        r = {}
        with torch.no_grad():
            r["conv1_fwd"] = t(lambda: m.conv1_gelu(x, w, b))
            r["bias_gelu_fwd"] = t(lambda: m.bias_gelu(y2, b))
        y = m.conv1_gelu(x, w, b)
        r["conv1_fwd_bwd"] = t(lambda: torch.autograd.grad(m.conv1_gelu(x, w, b), [w, b], g1))
        r["bias_gelu_fwd_bwd"] = t(lambda: torch.autograd.grad(m.bias_gelu(y2, b), [y2, b], g2))
        res.setdefault(name, []).append(r)
        outs[name] = (y.float(), *[a.float() for a in torch.autograd.grad(m.conv1_gelu(x, w, b), [w, b], g1)],
                      m.bias_gelu(y2, b).float(), *[a.float() for a in torch.autograd.grad(m.bias_gelu(y2, b), [y2, b], g2)])
diff = [float((a - c).abs().max() / c.abs().max()) for a, c in zip(outs["new"], outs["old"])]
ne = [float((a != c).float().mean()) for a, c in zip(outs["new"], outs["old"])]
print(json.dumps({"chunks": K, "ms": res, "rel_max_diff_new_vs_old": diff, "frac_differing": ne}, indent=1))
