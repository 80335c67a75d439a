"""Where a CUDA training step's time goes, eager PyTorch beside ortlab (needs a GPU and onnxruntime-gpu).

    python benchmarks/cuda_profile.py kernels gpt2s resnet18  # GPU kernel time a step, top kernels (torch.profiler:
                                                              # CUPTI sees onnxruntime's kernels too)
    python benchmarks/cuda_profile.py cpu resnet18            # onnxruntime's nodes by host time, those on its CPU provider
    python benchmarks/cuda_profile.py sync gpt                # onnxruntime's end-of-run synchronization on vs off
    python benchmarks/cuda_profile.py copies gpt2s            # the device-to-host copies of one step, and who made them

Models are ``benchmarks/train_step.py``'s. ``DEV=cpu`` runs the same on the CPU (to try the script).
Results: ``benchmarks/results/h200/``.
"""
from __future__ import annotations

import collections
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_step's models
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ortlab from a plain checkout
import torch  # noqa: E402  torch first, as users' scripts do
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import ortlab  # noqa: E402
import train_step as ts  # noqa: E402

ts.DEVICE = torch.device(os.environ.get('DEV', 'cuda'))
if ts.DEVICE.type == 'cpu':  # to try the script without a GPU
    torch.cuda.synchronize = lambda *a: None


def batches(draw, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(t.to(ts.DEVICE) for t in draw(g)) for _ in range(n)]


def step(model, opt, batch):
    loss = model(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def kernels(name):
    base, draw, _ = ts.build_model(name)
    base = base.to(ts.DEVICE)
    bs = batches(draw, 4)
    for label, model in (('eager', copy.deepcopy(base)), ('ortlab', ortlab.ORTModule(copy.deepcopy(base)))):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for b in bs[:2]:
            step(model, opt, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in bs[2:]:
                step(model, opt, b)
            torch.cuda.synchronize()
        ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in ev) / 2 / 1000
        print(f'\n[{name} {label}] GPU kernel time per step {total:.2f} ms; top kernels (ms/step, calls/step):')
        for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:14]:
            print(f'   {e.self_device_time_total / 2000:8.3f} {e.count // 2:5d}  {e.key[:110]}')
        if label == 'ortlab':
            for c in model.report.captures:
                for gr in c.graphs:
                    for p in gr.parts:
                        s = p.runner.session
                        if s is None:
                            continue
                        print('  ', gr.label, 'session providers', s.get_providers())
            print('   fallbacks:', sorted({f"{f.kind or f.scope}: {f.op or f.reason.splitlines()[0][:80]}" for f in model.report.fallbacks}))
            print('   graphs:', [gr.label for c in model.report.captures for gr in c.graphs])


def nodes_on_cpu(name):
    base, draw, _ = ts.build_model(name)
    om = ortlab.ORTModule(base.to(ts.DEVICE), profile=True)
    opt = torch.optim.SGD(om.parameters(), lr=1e-3)
    for b in batches(draw, 3):
        step(om, opt, b)
    torch.cuda.synchronize()
    for c in om.report.captures:
        for gr in c.graphs:
            for p in gr.parts:
                if p.runner.session is None:
                    continue
                f = p.runner.session.end_profiling()
                by, cnt = collections.Counter(), collections.Counter()
                for e in json.load(open(f)):
                    if e.get('cat') == 'Node' and e['name'].endswith('_kernel_time'):
                        a = e.get('args', {})
                        by[(a.get('op_name'), a.get('provider'))] += e['dur']
                        cnt[(a.get('op_name'), a.get('provider'))] += 1
                print(f'\n[{name} {gr.label}] host time of onnxruntime nodes (us/run; not GPU time), top:')
                for k, v in by.most_common(8):
                    print(f'   {v / 3:9.0f} {cnt[k] // 3:4d} {k}')
                print('   on the CPU provider:', sorted((k[0], cnt[k] // 3) for k in by if k[1] == 'CPUExecutionProvider'))


def sync_ab(name, steps=30):
    base, draw, _ = ts.build_model(name)
    base = base.to(ts.DEVICE)
    bs = batches(draw, steps + 2)
    runs = {}
    for label in ('sync', 'nosync'):
        om = ortlab.ORTModule(copy.deepcopy(base))
        opt = torch.optim.SGD(om.parameters(), lr=1e-3)
        step(om, opt, bs[0])
        if label == 'nosync':
            for c in om.report.captures:
                for gr in c.graphs:
                    for p in gr.parts:
                        p.runner._run_options.add_run_config_entry('disable_synchronize_execution_providers', '1')
        runs[label] = (om, opt, [])
    eager = copy.deepcopy(base)
    runs['eager'] = (eager, torch.optim.SGD(eager.parameters(), lr=1e-3), [])
    step(eager, runs['eager'][1], bs[0])
    losses = collections.defaultdict(list)
    for b in bs[1:]:
        for label, (m, opt, times) in runs.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(m, opt, b)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            losses[label].append(loss.item())
    e = statistics.median(runs['eager'][2])
    print(f'\n[{name}] whole steps, one sync per step: ' + ', '.join(
        f'{k} {statistics.median(v[2]):.2f} ms ({e / statistics.median(v[2]):.2f}x eager)' for k, v in runs.items()))
    print('   last losses', {k: v[-1] for k, v in losses.items()})


def copies(name):
    base, draw, _ = ts.build_model(name)
    om = ortlab.ORTModule(base.to(ts.DEVICE))
    opt = torch.optim.SGD(om.parameters(), lr=1e-3)
    bs = batches(draw, 3)
    for b in bs[:2]:
        step(om, opt, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step(om, opt, bs[2])
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and 'DtoH' in e.name:
            print(f'{e.name} {e.device_time:.0f} us')
    for e in prof.key_averages(group_by_stack_n=8):
        if e.key in ('cudaMemcpyAsync', 'cudaMemcpy', 'aten::_local_scalar_dense', 'aten::copy_', 'aten::nonzero',
                     'cudaStreamSynchronize'):
            print(f'{e.key} x{e.count} cpu {e.cpu_time_total:.0f} us; stack: {e.stack[:8]}')


what = sys.argv[1]
for name in sys.argv[2:]:
    try:
        {'kernels': kernels, 'cpu': nodes_on_cpu, 'sync': sync_ab, 'copies': copies}[what](name)
    except Exception as exc:
        import traceback
        traceback.print_exc(limit=4)
        print(name, 'FAILED', type(exc).__name__, str(exc)[:300])
