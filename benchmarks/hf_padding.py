"""Embedding sparsity across Hugging Face text architectures, beside eager PyTorch.

Not a benchmark: a check that ``embedding_sparsity=True`` (Note [Embedding sparsity] in
``ortlab.capture.padding``) never changes a result. The text models of
``hf_architectures.py`` (small configs, random weights, ``pad_token_id=0``) train two SGD steps
from equal weights on right-padded batches (a third to two thirds of each row is ``[PAD]``,
with the attention mask a tokenizer gives and labels -100 on padding), dropout off and
``use_cache=False`` (a decoder's returned key/value cache is not laid out by token, so its
padded rows count as a change and the check keeps every row), beside eager. Losses and gradients are compared at rtol 1e-4 / atol 1e-5. Each line says whether
embedding sparsity applied (and how many rows it dropped) or why not: a model whose
embedding has no ``padding_idx``, or whose padded tokens change the others' results (the
check on each padded batch), keeps every row; either way the numbers must be eager's.

    python benchmarks/hf_padding.py              # every text architecture (~3 minutes on 2 cores)
    python benchmarks/hf_padding.py roberta opt  # some
    python benchmarks/hf_padding.py --providers OpenVINOExecutionProvider  # every part on OpenVINO
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch  # torch first, as users' scripts do

import ortlab

sys.path.insert(0, str(Path(__file__).parent))
from hf_architectures import (  # noqa: E402
    CASES, V, _without_dropout, cls_eos, parse_args, parts_on, train_beside_eager)

# The architectures of hf_architectures.py whose batches are token ids (lm, cls, cls_eos).
TEXT = ("mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2", "falcon", "gpt_neox", "gptj", "gpt_neo", "bloom",
        "opt", "codegen", "stablelm", "olmo", "roberta", "electra", "albert", "deberta_v2", "deberta", "xlnet", "mpnet",
        "funnel", "bart_cls")


# Config keys of dropout probabilities (functional dropout, F.dropout(x, p=config.dropout), is no
# nn.Dropout that _without_dropout could turn off); a key a config does not know is kept unused.
NO_DROPOUT = {k: 0.0 for k in ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout",
                               "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop",
                               "attn_pdrop", "classifier_dropout", "embedding_dropout", "summary_last_dropout")}


def padded(batch_fn):  # noqa: ANN001, ANN201
    """``batch_fn``'s batches, right-padded with token 0 and masked as a tokenizer would."""
    def draw(g: torch.Generator) -> dict:
        batch = dict(batch_fn(g))
        ids = batch["input_ids"]
        n, t = ids.shape
        lengths = torch.randint(t // 3, t, (n,), generator=g)
        lengths[0] = t  # one full row, as the longest sentence of a batch is
        keep = torch.arange(t)[None] < lengths[:, None]
        if batch_fn is cls_eos:  # BART classifies at the last end-of-sequence token: keep one in each row
            ids = ids.clone()
            ids[torch.arange(n), lengths - 1] = 2
        batch["input_ids"] = ids.masked_fill(~keep, 0)
        batch["attention_mask"] = keep.long()
        if "labels" in batch and batch["labels"].shape == ids.shape:
            batch["labels"] = batch["labels"].masked_fill(~keep, -100)
        return batch

    return draw


def compare(name: str, model: torch.nn.Module, batch_fn, steps: int = 2, **options: object) -> str:  # noqa: ANN001
    start = time.perf_counter()
    model = _without_dropout(model).train()
    eager = copy.deepcopy(model)
    om = ortlab.ORTModule(model, embedding_sparsity=True, **options)
    worst, gaps, _ = train_beside_eager(om, eager, batch_fn, steps)
    records = [c.padding for c in om.report.captures if c.padding is not None and c.same_as is None]
    padding = "; ".join(_short(r) for r in records) or "no embedding with a padding_idx in a captured graph"
    verdict = "OK" if not gaps else f"DIFFERS from eager ({gaps[0]}; {len(gaps)} in all)"
    where = f"; parts on {parts_on(om)}" if options else ""
    return (f"{name:<12} {verdict}; largest gradient difference {worst:.1e}; {time.perf_counter() - start:.1f} s; "
            f"{padding}{where}")


def _short(record: object) -> str:
    if record.applied:  # type: ignore[attr-defined]
        return (f"on at {record.module}: dropped {record.total_dropped} of {record.total_rows} rows, "  # type: ignore[attr-defined]
                f"{record.packed_ops} ops on the kept rows")  # type: ignore[attr-defined]
    return f"off at {record.module}: {record.reason}"  # type: ignore[attr-defined]


def main() -> None:
    warnings.simplefilter("ignore")
    args = parse_args(known=TEXT, description=__doc__.splitlines()[0])
    options = {"providers": args.providers.split(",")} if args.providers else {}
    names = args.names or TEXT
    print(f"torch {torch.__version__}, ortlab {ortlab.__version__}; vocab {V}, pad_token_id 0, dropout off"
          + (f"; providers pinned to {options['providers']}" if options else ""))
    for name in names:
        try:
            torch.manual_seed(0)
            model, batch = CASES[name](pad_token_id=0, use_cache=False, **NO_DROPOUT)
            print(compare(name, model, padded(batch), **options), flush=True)
        except Exception as e:  # noqa: BLE001 - report every architecture
            print(f"{name:<12} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    main()
