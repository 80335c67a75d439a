"""A convolution's weight gradient, patches stacked from the input as it is against from the input with
batch and channels swapped (Note [Convolution gradients as GEMMs] in ``ortlab/capture/decompositions.py``).

Two ORTModules of one model in one process, one captured with each form of the decomposition (the
former kept here as ``old_wg``), their steps alternated; first the gradients of both are compared.

    python benchmarks/conv_weight_grad_layout.py resnet18 30
"""
import copy
import os
import statistics
import sys
import time

import torch

import ortlab
import ortlab.capture.decompositions as D
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as TS  # noqa: E402


def old_wg(grad_output, input, weight_shape, stride, padding, dilation):  # noqa: A002
    """The decomposition before 2026-11-27: windows of the input as it is, then a permute of every float."""
    kh, kw = weight_shape[2], weight_shape[3]
    batch, cout, ho, wo = grad_output.shape
    cin = input.shape[1]
    x = torch.nn.functional.pad(input, (padding[1], padding[1], padding[0], padding[0]))
    patches = []
    for i in range(kh):
        for j in range(kw):
            top, left = i * dilation[0], j * dilation[1]
            patches.append(x[:, :, top:top + stride[0] * (ho - 1) + 1:stride[0],
                             left:left + stride[1] * (wo - 1) + 1:stride[1]])
    cols = torch.stack(patches, dim=2)
    cols = cols.permute(0, 3, 4, 1, 2).reshape(batch * ho * wo, cin * kh * kw)
    go = grad_output.permute(1, 0, 2, 3).reshape(cout, batch * ho * wo)
    return torch.mm(go, cols).reshape(cout, cin, kh, kw)


name = sys.argv[1]
base, draw, _ = TS.build_model(name)
batch = draw(torch.Generator().manual_seed(0))
old, new_wg = old_wg, D._conv2d_weight_grad
mods = {}
for key in ("old", "new"):
    D._conv2d_weight_grad = old if key == "old" else new_wg
    m = ortlab.ORTModule(copy.deepcopy(base))
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    mods[key] = (m, opt)
    for _ in range(2):
        m(*batch).backward(); opt.step(); opt.zero_grad()
D._conv2d_weight_grad = new_wg
# same grads?
g = {}
for k, (m, opt) in mods.items():
    m.load_state_dict(base.state_dict()); m.zero_grad(); m(*batch).backward()
    g[k] = {n: p.grad.clone() for n, p in m.named_parameters()}
    opt.zero_grad()
worst = max(((g["old"][n] - g["new"][n]).abs().max() / (g["old"][n].abs().max() + 1e-30)).item() for n in g["old"])
print("worst relative grad difference old vs new:", worst)
ts = {k: [] for k in mods}
for i in range(int(sys.argv[2])):
    for k, (m, opt) in mods.items():
        t = time.perf_counter(); m(*batch).backward(); opt.step(); opt.zero_grad(); ts[k].append(time.perf_counter() - t)
a, b = statistics.median(ts["old"]), statistics.median(ts["new"])
print("old %.1f ms  new %.1f ms  speedup %.3f" % (a*1e3, b*1e3, a/b))
