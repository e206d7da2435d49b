"""The coded pipeline boundary on CUDA, in one process (issue 40: the CUDA twin).

* every boundary message a CUDA tensor makes (int8/int4 through the ``wq`` CUDA
  kernels, fp32/bf16 as bytes, token ids beside them) is byte-equal to the message
  the same values make on the CPU (the C codec), and decodes to the same values;
* two stages of a GPT-2 (plain and subspace) joined by a boundary on the device, one
  microbatch forward and backward, against a one-process model on the device that
  applies the same code with torch ops at the same place: the message, the decoded
  activation and the loss bit-equal, every gradient within fp32 atomics' reordering
  (CUDA attention and embedding backward may sum in another order from run to run).

Two ranks cannot share one GPU (NCCL refuses), so the send itself is the CPU tests'
(tests/test_pipeline.py).  Skipped without a CUDA device or a CUDA build of ``_tagc``;
``TAGC_CUDA_TEST_DEVICE=cpu`` runs the same harness on the CPU (a self-check of this
file, not of CUDA).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

_tagc = pytest.importorskip("_tagc")
from cuda_helpers import DEV, needs_cuda
from test_pipeline import _QDQ, qdq_ref
from tagc.pipeline import (BoundaryCounter, BoundaryLayout, BoundaryRecv, BoundarySend,
                           CompressedStage, PipelineConfig)
from tagc.train.model import GPT, GPTConfig, GPTStage, stage_ranges

pytestmark = [needs_cuda(_tagc), pytest.mark.cuda, pytest.mark.codec]


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shape,block", [((1, 1, 1), 1), ((3, 7, 130), 64),
                                         ((2, 33, 768), 64), ((1, 2, 4099), 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_messages_equal_the_cpu_codec(fmt: str, shape: Tuple[int, ...], block: int,
                                      dtype: torch.dtype) -> None:
    cfg = PipelineConfig(format=fmt, grad_format=fmt, block=block, subspace_k=shape[-1])
    rows = math.prod(shape[:-1])
    lay = BoundaryLayout(shape, cfg, shape[:-1], 50257)
    g = torch.Generator().manual_seed(rows * shape[-1] + block)
    x = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    x.view(-1)[0] = 0.0
    ids = torch.randint(0, 50257, shape[:-1], generator=g)
    cpu = lay.pack_forward(x, ids)
    dev = lay.pack_forward(x.to(DEV), ids.to(DEV))
    assert dev.device.type == torch.device(DEV).type
    assert torch.equal(dev.cpu().view(torch.uint8), cpu.view(torch.uint8))
    xv, iv = lay.unpack_forward(dev)
    assert torch.equal(xv.cpu(), qdq_ref(x, fmt, block)) and torch.equal(iv.cpu(), ids)
    back = lay.pack_backward(x.to(DEV))
    assert torch.equal(back.cpu().view(torch.uint8), lay.pack_backward(x).view(torch.uint8))
    assert torch.equal(lay.unpack_backward(back).cpu(), qdq_ref(x, fmt, block))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("fmt,gfmt,k", [("int8", None, 0), ("int4", "int8", 0),
                                        ("bf16", None, 0), ("int8", "fp32", 8),
                                        ("int4", None, 8)])
def test_two_stages_on_the_device_equal_one_process_reference(
        fmt: str, gfmt: Optional[str], k: int) -> None:
    cfg = PipelineConfig(format=fmt, grad_format=gfmt, block=16, subspace_k=k)
    gcfg = GPTConfig(block_size=8, vocab_size=64, n_layer=3, n_head=2, n_embd=40,
                     tie_weights=False, subspace_k=k, subspace_layers=2 if k else 0)
    split = stage_ranges(3, 2)[0][1]
    torch.manual_seed(0)
    ref = GPT(gcfg).to(DEV)
    stages = []
    for s in range(2):
        torch.manual_seed(0)
        stages.append(GPTStage(GPT(gcfg), s, 2).to(DEV))
    gen = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 64, (2, 8), generator=gen).to(DEV)
    y = torch.randint(0, 64, (2, 8), generator=gen).to(DEV)
    lay = BoundaryLayout((2, 8, k or 40), cfg, (2, 8) if k else None, 64 if k else 0)
    c0, c1 = BoundaryCounter(), BoundaryCounter()
    first = CompressedStage(stages[0], None, BoundarySend(lay, c0), lay, c0)
    last = CompressedStage(stages[1], BoundaryRecv(lay, c1), None, lay, c1)

    msg = first(idx)
    assert msg.device.type == torch.device(DEV).type and msg.shape == (lay.message_numel,)
    got = msg.detach().requires_grad_()
    logits = last(got)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    msg.backward(got.grad)

    h = ref.blocks(ref.embed(idx), 0, split)
    h = (_QDQ.apply(h[0], cfg), h[1]) if k else _QDQ.apply(h, cfg)
    ref_logits = ref.head(ref.blocks(h, split, 3))
    ref_loss = F.cross_entropy(ref_logits.view(-1, ref_logits.size(-1)), y.view(-1))
    ref_loss.backward()

    assert torch.equal(loss.detach(), ref_loss.detach())
    assert c0.counts["forward_messages"] == c1.counts["backward_messages"] == 1
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for st in stages:
        for n, p in st.model.named_parameters():
            assert p.grad is not None, n
            assert _rel(p.grad, grads[n]) < 1e-5, (n, _rel(p.grad, grads[n]))
