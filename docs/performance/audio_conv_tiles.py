"""Tile sweep of the fused audio conv passes at 500 chunks: acf_old.py (ca3a269's model_bridge/modeling/audio_conv_fused.py,
position-first grids; git show ca3a269:model_bridge/modeling/audio_conv_fused.py > .probe/acf_old.py, its
relative import made absolute) against the
checkout's channel-block-first grids, forward and backward timed apart; writes JSON to argv[1]."""
import importlib, json, sys, torch
from _front_end_inputs import cuda_ms, front_end_inputs
sys.path.insert(0, ".probe")
dev = "cuda"
old = importlib.import_module("acf_old")
new = importlib.import_module("model_bridge.modeling.audio_conv_fused")
K = 500
x, w, b, y2, g1, g2 = front_end_inputs(K)
t = cuda_ms

def run(m):
    r = {}
    with torch.no_grad():
        r["conv1_fwd"] = t(lambda: m.conv1_gelu(x, w, b))
        r["bias_gelu_fwd"] = t(lambda: m.bias_gelu(y2, b))
    y = m.conv1_gelu(x, w, b)
    r["conv1_bwd"] = t(lambda: torch.autograd.grad(y, [w, b], g1, retain_graph=True))
    z = m.bias_gelu(y2, b)
    r["bias_gelu_bwd"] = t(lambda: torch.autograd.grad(z, [y2, b], g2, retain_graph=True))
    outs = [y.float(), *[a.float() for a in torch.autograd.grad(y, [w, b], g1)],
            z.float(), *[a.float() for a in torch.autograd.grad(z, [y2, b], g2)]]
    return r, outs

res = {"chunks": K, "gpu": torch.cuda.get_device_name(), "old": [], "new_default": []}
ref = None
for rnd in range(2):
    r, ref = run(old); res["old"].append(r)
    r, o = run(new); res["new_default"].append(r)
res["new_default_rel_diff"] = [float((a - c).abs().max() / c.abs().max()) for a, c in zip(o, ref)]
tiles = {"_BIAS_GELU_FWD_TILE": [(64, 64, 4), (32, 128, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 512, 8)],
         "_BIAS_GELU_BWD_TILE": [(64, 64, 4), (32, 128, 4), (16, 256, 4), (32, 256, 8), (16, 512, 8), (64, 128, 8)],
         "_CONV1_BWD_TILE": [(64, 32, 4), (128, 64, 8), (64, 64, 4), (32, 128, 4), (64, 128, 8), (128, 32, 8), (256, 32, 8)],
         "_CONV1_FWD_TILE": [(64, 32, 4), (256, 32, 8), (128, 64, 8), (64, 64, 4), (128, 32, 8)]}
key = {"_BIAS_GELU_FWD_TILE": "bias_gelu_fwd", "_BIAS_GELU_BWD_TILE": "bias_gelu_bwd", "_CONV1_BWD_TILE": "conv1_bwd", "_CONV1_FWD_TILE": "conv1_fwd"}
best = {}
for name, cands in tiles.items():
    base = getattr(new, name)
    rows = [(base, res["new_default"][-1][key[name]])]
    for tile in cands:
        setattr(new, name, tile)
        try:
            r, o = run(new)
            d = max(float((a - c).abs().max() / c.abs().max()) for a, c in zip(o, ref))
            rows.append((tile, r[key[name]], d))
        except Exception as e:
            rows.append((tile, None, repr(e)[:200]))
        print(name, rows[-1], flush=True)
    for ppsm in (2, 8):
        new._PROGRAMS_PER_SM = ppsm
        setattr(new, name, base)
        r, _ = run(new)
        rows.append((f"{base} x{ppsm}/SM", r[key[name]]))
        new._PROGRAMS_PER_SM = 4
    setattr(new, name, base)
    ok = [rw for rw in rows if isinstance(rw[1], float) and isinstance(rw[0], tuple)]
    best[name] = min(ok, key=lambda rw: rw[1])[0]
    res[name] = rows
res["best"] = best
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
