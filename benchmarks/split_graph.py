"""How long proposing the onnxruntime parts of a graph takes: torch's CapabilityBasedPartitioner
against ortlab's parts by depth (Note [Parts by depth] in ``ortlab/runtime/split.py``).

Trains one step of a Hugging Face MobileNetV2 (random weights, batch 8, 96x96: its 17 depthwise
convolution gradients run in PyTorch) and of a GPT-2 with dropout (each dropout runs in PyTorch),
keeps every graph ortlab split, then proposes its parts both ways on the same graph, in turns.
Prints the median times and the number of parts each way.

    python benchmarks/split_graph.py
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch  # torch first, as users' scripts do

import ortlab
import ortlab.runtime.split as split
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

transformers = __import__("transformers")


def _graphs(model: torch.nn.Module, batch: dict) -> list[tuple[torch.fx.GraphModule, set]]:
    seen = []
    original = split.split_graph

    def record(gm, in_pytorch, make_part, random=()):  # noqa: ANN001, ANN202
        if in_pytorch:
            seen.append((split.copy_graph(gm), set(in_pytorch)))
        return original(gm, in_pytorch, make_part, random)

    split.split_graph = record
    import ortlab.pipeline.graph as pipeline_graph
    pipeline_graph.split_graph = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ortlab.ORTModule(model)(**batch).loss.backward()
    finally:
        split.split_graph = pipeline_graph.split_graph = original
    return seen


def main() -> None:
    torch.manual_seed(0)
    mobilenet = transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config(image_size=96, num_labels=10, classifier_dropout_prob=0.0))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=1000,
                                                                n_positions=64, bos_token_id=0,
                                                                eos_token_id=0))
    ids = torch.randint(0, 1000, (4, 64))
    cases = {
        "MobileNetV2": _graphs(mobilenet, {"pixel_values": torch.randn(8, 3, 96, 96),
                                           "labels": torch.randint(0, 10, (8,))}),
        "GPT-2 with dropout": _graphs(gpt2, {"input_ids": ids, "labels": ids}),
    }
    for name, graphs in cases.items():
        for i, (gm, in_pytorch) in enumerate(graphs):
            support = split._Support(in_pytorch)
            times: dict[str, list[float]] = {"torch": [], "depth": []}
            counts = {}
            for _ in range(3):
                start = time.perf_counter()
                parts = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True).propose_partitions()
                times["torch"].append(time.perf_counter() - start)
                counts["torch"] = len([p for p in parts if any(split._worth_running(n) for n in p.nodes)])
                start = time.perf_counter()
                parts = split._partitions_by_depth(gm, support)
                times["depth"].append(time.perf_counter() - start)
                counts["depth"] = len([p for p in parts if any(split._worth_running(n) for n in p.nodes)])
            nodes = len(gm.graph.nodes)
            print(f"{name} graph {i} ({nodes} nodes, {len(in_pytorch)} in PyTorch): "
                  f"CapabilityBasedPartitioner {statistics.median(times['torch']):.3f} s, {counts['torch']} parts; "
                  f"by depth {statistics.median(times['depth']):.3f} s, {counts['depth']} parts")


if __name__ == "__main__":
    main()
