"""cuDNN's two 480-channel convs of the audio front-end at 500 chunks, bf16 channels-last: forward and
forward+backward, heuristics (benchmark off) against cudnn.benchmark, and each conv's TFLOP/s."""
import json, sys, torch, torch.nn.functional as F
from _front_end_inputs import cuda_ms
dev = "cuda"
K = 500
h1 = torch.randn(K, 480, 64, 50, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last).requires_grad_()
w2 = (torch.randn(480, 480, 3, 3, device=dev) * 0.02).bfloat16().contiguous(memory_format=torch.channels_last).requires_grad_()
w3 = (torch.randn(480, 480, 3, 3, device=dev) * 0.02).bfloat16().contiguous(memory_format=torch.channels_last).requires_grad_()

def t(fn):
    return cuda_ms(fn, n=10)

def fwd2(): return F.conv2d(h1, w2, None, stride=2, padding=1)
y2 = fwd2().detach().requires_grad_()
def fwd3(): return F.conv2d(y2, w3, None, stride=2, padding=1)
g2 = torch.randn_like(fwd2()); g3 = torch.randn_like(fwd3())
fl2 = 2 * K * 32 * 25 * 480 * 480 * 9; fl3 = 2 * K * 16 * 13 * 480 * 480 * 9
res = {"gpu": torch.cuda.get_device_name()}
for bench in (False, True, False, True):
    torch.backends.cudnn.benchmark = bench
    r = {}
    with torch.no_grad():
        r["conv2_fwd"] = t(fwd2); r["conv3_fwd"] = t(fwd3)
    o2, o3 = fwd2(), fwd3()
    r["conv2_bwd"] = t(lambda: torch.autograd.grad(o2, [h1, w2], g2, retain_graph=True))
    r["conv3_bwd"] = t(lambda: torch.autograd.grad(o3, [y2, w3], g3, retain_graph=True))
    r["tflops"] = {"conv2_fwd": fl2 / r["conv2_fwd"] / 1e9, "conv3_fwd": fl3 / r["conv3_fwd"] / 1e9,
                   "conv2_bwd": 2 * fl2 / r["conv2_bwd"] / 1e9, "conv3_bwd": 2 * fl3 / r["conv3_bwd"] / 1e9}
    res.setdefault("benchmark" if bench else "heuristics", []).append(r)
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
