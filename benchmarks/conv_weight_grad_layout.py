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


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> float:
    start = time.perf_counter()
    model(*batch).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def main() -> None:
    name, steps = sys.argv[1], int(sys.argv[2])
    base, draw, _ = TS.build_model(name)
    batch = draw(torch.Generator().manual_seed(0))
    new_wg = D._conv2d_weight_grad
    mods = {}
    try:
        for key, form in (("old", old_wg), ("new", new_wg)):
            D._conv2d_weight_grad = form  # read when the ORTModule captures its graph, on its first step
            m = ortlab.ORTModule(copy.deepcopy(base))
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            mods[key] = (m, opt)
            for _ in range(2):
                step(m, opt, batch)
    finally:
        D._conv2d_weight_grad = new_wg
    grads = {}
    for key, (m, opt) in mods.items():  # one step from the same weights: the same gradients?
        m.load_state_dict(base.state_dict())
        m.zero_grad()
        m(*batch).backward()
        grads[key] = {n: p.grad.clone() for n, p in m.named_parameters()}
        opt.zero_grad()
    old, new = grads["old"], grads["new"]
    worst = max(((old[n] - new[n]).abs().max() / (old[n].abs().max() + 1e-30)).item() for n in old)
    print("worst relative grad difference old vs new:", worst)
    times = {key: [] for key in mods}
    for _ in range(steps):
        for key, (m, opt) in mods.items():
            times[key].append(step(m, opt, batch))
    a, b = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"old {a * 1e3:.1f} ms  new {b * 1e3:.1f} ms  speedup {a / b:.3f}")


if __name__ == "__main__":
    main()
