"""Hugging Face models under TAGC: GPT-2 (Conv1D, fused c_attn, tied embedding) and Llama
(q/k/v_proj, o_proj, gate/up/down_proj), FSDP1 and FSDP2, 2 gloo ranks, tiny configs
built offline.

Each case: the default selection compresses at least 75% of the parameters and keeps
the attention inputs out of compressed units; ``dense`` and ``exact`` at theta 0 give
plain FSDP's gradients; ``exact`` at theta 0.9875 without error feedback gives the
independent reference (the sum over ranks of each rank's top-k of its shard, divided as
FSDP divides).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from dist_helpers import SharedSpawn, local_grads, run_cases, run_dist

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[test]')")
pytestmark = [pytest.mark.codec, pytest.mark.dist]

import tagc_hook as tagc  # noqa: E402

MIN_NUMEL = 1024
VOCAB, SEQ = 512, 16


def _model(name: str) -> torch.nn.Module:
    """A tiny model of the family, the same weights on every rank."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if name.startswith("gpt2"):
        m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                       n_positions=64, bos_token_id=0, eos_token_id=0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       tie_word_embeddings=name == "gpt2"))
    else:
        m = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64,
                                         intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=VOCAB,
                                         bos_token_id=0, eos_token_id=0,
                                         tie_word_embeddings=name == "llama-tied"))
    if name == "llama":  # a frozen parameter inside a compressed unit's module
        m.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    return m


def _wrap(name: str, kind: str, cfg: tagc.TAGCConfig) -> torch.nn.Module:
    model = _model(name)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, auto_wrap_policy=tagc.fsdp1_auto_wrap_policy(model, cfg),
                    device_id=torch.device("cpu"), use_orig_params=True)
    return tagc.shard_model(model, cfg)


def _backward(model: torch.nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    model(input_ids=x, labels=x).loss.backward()


def _cfg(mode: str, **kw: Any) -> tagc.TAGCConfig:
    # the knobs whose library defaults became tagc-balanced's (issue 38), pinned to the
    # values these tests were written for: the paper's selection, residual feedback
    kw.setdefault("layers", "non_attention")
    kw.setdefault("ef21", False)
    kw.setdefault("residual_code", "none")  # the fp32 residual (issue 42's default: int4 codes)
    return tagc.TAGCConfig(mode=mode, min_numel=MIN_NUMEL, **kw)


def _coverage(rank: int, n: int, name: str, kind: str) -> float:
    """>= 75% of the parameters in compressed units; QKV never in one."""
    cfg = _cfg("exact")
    model = _wrap(name, kind, cfg)
    state = tagc.register(model, cfg)
    comp = sum(u.numel for u in state.units if u.compressed)
    frac = comp / sum(u.numel for u in state.units)
    assert frac >= 0.75, (name, kind, frac, [(u.name, u.compressed) for u in state.units])
    for u in state.units:
        if any(q in u.name for q in ("c_attn", "q_proj", "k_proj", "v_proj")):
            assert not u.compressed, u.name
    tied = name in ("gpt2", "llama-tied")
    root = next(u for u in state.units if u.name == "<root>")
    assert root.compressed == tied  # the tied embedding/LM head lives in the root unit
    return frac


def _equal_plain(rank: int, n: int, name: str, kind: str) -> None:
    """dense and exact at theta 0: plain FSDP's gradients, unit for unit."""
    ref = _wrap(name, kind, _cfg("dense"))
    mods = [_wrap(name, kind, c) for c in (_cfg("dense"), _cfg("exact", theta=0.0))]
    for m, c in zip(mods, (_cfg("dense"), _cfg("exact", theta=0.0))):
        tagc.register(m, c)
    for step in range(2):
        _backward(ref, rank, step)
        want = local_grads(ref)
        scale = max(float(g.abs().max()) for g in want if g.numel())
        for m in mods:
            _backward(m, rank, step)
            for i, (a, b) in enumerate(zip(local_grads(m), want)):
                err = float((a - b).abs().max()) / scale if b.numel() else 0.0
                assert err <= 1e-6, (name, kind, step, i, err)
            m.zero_grad()
        ref.zero_grad()


def _topk_reference(rank: int, n: int, name: str, kind: str) -> int:
    """exact at theta 0.9875 without error feedback: each owner's output is the sum
    over ranks of each rank's top-k of its shard (ties to lower positions), divided
    as FSDP divides; checked for every compressed unit."""
    cfg = _cfg("exact", theta=0.9875, error_feedback=False)
    model = _wrap(name, kind, cfg)
    state = tagc.register(model, cfg)
    seen: Dict[str, Tuple[torch.Tensor, torch.Tensor, float]] = {}
    for u in state.units:
        orig = u.reduce

        def run(inp: torch.Tensor, out: torch.Tensor, u: Any = u, orig: Any = orig) -> None:
            x = inp.detach().reshape(-1).clone()
            orig(inp, out)
            seen[u.name] = (x, out.detach().clone(), u.pre * u.post)

        u.reduce = run  # type: ignore[method-assign]
    _backward(model, rank, 0)
    checked = 0
    for u in state.units:
        if not u.compressed or u.name not in seen:  # a frozen unit reduces nothing
            continue
        x, out, div = seen[u.name]
        s = out.numel()
        every = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(every, x)
        k = min(max(math.ceil(round((1 - cfg.theta) * s, 9)), 1), s)
        want = torch.zeros(s, dtype=torch.float64)
        for r in range(n):
            shard = every[r][rank * s:(rank + 1) * s].double()
            keep = torch.sort(torch.sort(shard.abs(), descending=True, stable=True)
                              .indices[:k]).values
            want[keep] += shard[keep]
        torch.testing.assert_close(out.double(), want / div, rtol=1e-5,
                                   atol=1e-6 * float(want.abs().max()))
        checked += 1
    assert checked
    return checked


MODELS = ("gpt2", "gpt2-untied", "llama", "llama-tied")
CHECKS = (("coverage", _coverage), ("equal_plain", _equal_plain),
          ("topk_reference", _topk_reference))
CASES: List[Tuple[str, Any]] = [
    (f"{check}/{name}/{kind}", lambda r, n, fn=fn, name=name, kind=kind: fn(r, n, name, kind))
    for name in MODELS for kind in ("fsdp1", "fsdp2") for check, fn in CHECKS]


def _suite(rank: int, n: int) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    return run_cases(rank, n, CASES)


SPAWN = SharedSpawn(_suite, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_hf(case: str) -> None:
    """One case (every case shares one 2-rank spawn)."""
    SPAWN.case(2, case)


# ------------------------------------------------------------- finetune_hf.py (tagc.train.hf)

FAST = ["--progress=false", "--tokenizer=byte", "--batch_size=2", "--block_size=32",
        "--eval_iters=2", "--eval_interval=1000", "--log_interval=2", "--warmup_iters=0",
        "--tensorboard=false"]
LLAMA = ("llama:hidden_size=64,intermediate_size=128,num_hidden_layers=2,"
         "num_attention_heads=4,num_key_value_heads=2")


def _finetune(rank: int, world: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    from tagc.train.hf import main

    warnings.filterwarnings("ignore")
    return [main(argv) for argv in argvs]


def _first_val_loss(out_dir: Any) -> float:
    """The run's first logged validation loss (iteration 0: the model as built)."""
    import csv

    with open(out_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "val"]
    assert rows and int(rows[0]["iter"]) == 0, rows
    return float(rows[0]["loss"])


@pytest.mark.slow
def test_finetune_hf_from_config_and_checkpoint(tmp_path: Any) -> None:
    """finetune_hf.py: a Llama built from --hf_config with TAGC on FSDP2 learns (its
    validation loss falls well below the built model's), and a GPT-2 checkpoint
    folder (no tokenizer: byte tokens) on FSDP1, plain and with tagc-lean; then a
    resume: 3 steps + checkpoint + new processes + 3 == 6 straight (losses), while a
    checkpoint of a slightly different run (learning rate x 1.1) resumed the same
    way does not compare equal."""
    ckpt = tmp_path / "gpt2-ckpt"
    _model("gpt2").save_pretrained(ckpt)
    cache = f"--cache_dir={tmp_path / 'cache'}"
    lean = str(tagc.__file__).replace("tagc_hook.py", "configs/tagc-lean.yaml")
    # 1e-2: 4 steps take the built Llama from 5.79 to 4.26 (0.74x); at the default
    # 3e-4 it reaches 5.65 (0.98x), which "below log(vocab)" accepted as learning
    runs = [
        [*FAST, cache, f"--out_dir={tmp_path / 'llama'}", f"--hf_config={LLAMA}", "--fsdp=2",
         "--max_iters=4", "--learning_rate=1e-2", "--tagc=" + lean,
         "--tagc_set=min_numel=1024"],
        [*FAST, cache, f"--out_dir={tmp_path / 'gpt2-plain'}", f"--hf_model={ckpt}",
         "--max_iters=4"],
        [*FAST, cache, f"--out_dir={tmp_path / 'gpt2-split'}", f"--hf_model={ckpt}",
         "--max_iters=3", "--lr_decay_iters=6", "--tagc=" + lean, "--tagc_set=min_numel=1024"],
        [*FAST, cache, f"--out_dir={tmp_path / 'gpt2-straight'}", f"--hf_model={ckpt}",
         "--max_iters=6", "--lr_decay_iters=6", "--tagc=" + lean, "--tagc_set=min_numel=1024"],
        # the negative control's checkpoint: gpt2-split's first 3 steps at 1.1x the rate
        [*FAST, cache, f"--out_dir={tmp_path / 'gpt2-other'}", f"--hf_model={ckpt}",
         "--max_iters=3", "--lr_decay_iters=6", "--learning_rate=3.3e-4", "--tagc=" + lean,
         "--tagc_set=min_numel=1024"],
    ]
    first = run_dist(_finetune, 2, runs, timeout=400)[0]
    llama, plain = first[0], first[1]
    assert llama["iters"] == 4
    start = _first_val_loss(tmp_path / "llama")
    assert llama["final_val_loss"] < 0.85 * start, (start, llama["final_val_loss"])
    # at 1e-2 the Llama's loss falls 20% in one step, and the guard may send a unit plain
    # for that call (16 bits/param, counted in guard_resets): the ternary budget is
    # checked on the GPT-2 run at the default rate, where nothing resets
    assert llama["compressed_bits_per_param"] > 0
    straight = first[3]
    assert straight["guard_resets"] == 0, straight
    assert 0 < straight["compressed_bits_per_param"] < 1.0  # ternary: 0.88 at N=2
    assert plain["iters"] == 4 and plain["saved_pct"] == 0

    def resume(run: str) -> List[str]:
        """The straight run's arguments, continued from ``run``'s checkpoint."""
        return [*FAST, cache, f"--out_dir={tmp_path / run}", f"--hf_model={ckpt}",
                "--max_iters=6", "--lr_decay_iters=6", "--tagc=" + lean,
                "--tagc_set=min_numel=1024", "--init_from=resume"]

    resumed, other = run_dist(_finetune, 2, [resume("gpt2-split"), resume("gpt2-other")],
                              timeout=300)[0]
    assert resumed["iters"] == other["iters"] == 6
    assert resumed["final_val_loss"] == first[3]["final_val_loss"]  # bit-exact resume
    # the comparison can tell checkpoints apart: another one gives another loss
    assert other["final_val_loss"] != first[3]["final_val_loss"], other


def test_scripts_say_how_to_start_them() -> None:
    """Started with plain python: the scripts say to use torchrun (not torch's error)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(tagc.__file__).resolve().parent
    for script, args in (("finetune_hf.py", ["--hf_config", LLAMA]), ("train_gpt2.py", [])):
        env = {k: v for k, v in __import__("os").environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        r = subprocess.run([sys.executable, str(root / "scripts" / script), *args],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and "torchrun --standalone" in r.stderr, r.stderr[-2000:]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="Accelerate applies its FSDP plugin on accelerator devices only "
                           "(on CPU, --use_fsdp gives DDP or no distribution): needs 2 GPUs")
@pytest.mark.parametrize("version", ["1", "2"])
def test_accelerate_recipe(version: str) -> None:
    """The README's recipe end to end: accelerate launch, its FSDP plugin, tagc.register."""
    import subprocess
    from pathlib import Path

    root = Path(tagc.__file__).resolve().parent
    r = subprocess.run(["accelerate", "launch", "--num_processes", "2", "--use_fsdp",
                        "--fsdp_version", version, str(root / "scripts" / "accelerate_tagc.py"),
                        "--tagc", str(root / "configs" / "tagc-balanced.yaml"), "--steps", "3"],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0 and "compressed units sent" in r.stdout, r.stderr[-3000:]


def test_accelerate_recipe_script_parses() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(tagc.__file__).resolve().parent
    r = subprocess.run([sys.executable, str(root / "scripts" / "accelerate_tagc.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--tagc" in r.stdout
