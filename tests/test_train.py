"""scripts/train_gpt2.py and the tagc.train harness: config parsing, offline data preparation,
2-rank gloo training runs (plain FSDP and TAGC, FSDP1 and FSDP2) and bit-exact resume.

The multi-rank cases share spawns (tagc.train.launch.run_dist): each child imports torch,
which costs seconds on 2 busy cores, while a few tiny training steps cost milliseconds.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

import tagc.train.data as token_data
import tagc.train.model as gpt_model
from dist_helpers import run_dist
from tagc.train.checkpoint import choose
from tagc.train.config import load_tagc_config, parse_config
from tagc.train.loop import main
from tagc.train.optim import get_lr

PRESETS = REPO / "configs"

# Small and fast: tiny model (its MLP, attention-output and embedding weights have >= 2**16
# elements, so the presets compress them), short sequences, 2 eval batches; byte tokenizer
# even where tiktoken's GPT-2 files happen to be cached.
FAST = ["--progress=false", "--tokenizer=byte", "--batch_size=2", "--block_size=32",
        "--eval_iters=2", "--eval_interval=1000", "--log_interval=2", "--warmup_iters=0",
        "--learning_rate=2e-3"]


needs_tagc = pytest.mark.codec


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Token cache shared by the module's runs (stdlib corpus, byte tokenizer)."""
    d = tmp_path_factory.mktemp("token-cache")
    token_data.prepare(token_data.get_source("stdlib"), token_data.byte_tokenizer(), d)
    return d


# --------------------------------------------------------------------------- config

def test_the_hook_does_not_import_the_harness() -> None:
    """``import tagc_hook`` loads the library only, and the run drivers' helpers
    (tagc.train.runs) load without torch."""
    for code in ("import sys, tagc_hook; "
                 "bad = [m for m in sys.modules if m.startswith('tagc.train')]; "
                 "assert not bad, bad",
                 "import sys, tagc.train.runs; assert 'torch' not in sys.modules"):
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_config_overrides_are_typed_and_unknown_keys_raise(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text("max_iters: 7\nlearning_rate: 3.0e-4\nfsdp: 2\n")
    cfg = parse_config([str(y), "--batch_size=3", "--sharding", "SHARD_GRAD_OP",
                                   "--tensorboard", "--progress=false", "--tagc=none"])
    assert (cfg.max_iters, cfg.learning_rate, cfg.fsdp) == (7, 3e-4, 2)
    assert (cfg.batch_size, cfg.sharding, cfg.tensorboard, cfg.progress, cfg.tagc) == \
        (3, "SHARD_GRAD_OP", True, False, None)
    assert parse_config(["--config", str(y), "--max_iters=9"]).max_iters == 9
    with pytest.raises(ValueError, match="unknown config key"):
        parse_config(["--max_iter=5"])
    y.write_text("not_a_key: 1\n")
    with pytest.raises(ValueError, match="unknown config key"):
        parse_config([str(y)])
    for bad in (["--max_iters=1.5"], ["--fsdp=3"], ["--sharding=HYBRID_SHARD"],
                ["--progress=maybe"], ["--min_lr=1", "--learning_rate=0.1"],
                ["--tagc=/nonexistent.yaml"], ["--model=huge"], ["stray"],
                ["--replicas=0"], ["--replicas=2", "--fsdp=1"]):
        with pytest.raises(ValueError):
            parse_config(bad)


@needs_tagc
def test_tagc_set_overrides_preset_fields() -> None:
    import tagc_hook

    preset = str(PRESETS / "tagc-exact-warmup.yaml")
    cfg = parse_config(["--tagc", preset,
                                   "--tagc_set", "dense_steps=2000, warmup_steps=10000,theta=0.9"])
    t = load_tagc_config(tagc_hook, cfg)
    base = tagc_hook.TAGCConfig.from_yaml(preset)
    assert (t.dense_steps, t.warmup_steps, t.theta) == (2000, 10000, 0.9)
    assert (t.mode, t.warmup_theta, t.sketch_factor) == (base.mode, base.warmup_theta,
                                                         base.sketch_factor)
    assert load_tagc_config(tagc_hook, parse_config(
        ["--tagc", preset])) == base
    # a knob whose default follows another follows the override (ef21_damping <- ef21)
    balanced = str(PRESETS / "tagc-balanced.yaml")
    t = load_tagc_config(tagc_hook, parse_config(["--tagc", balanced, "--tagc_set",
                                                  "error_feedback=false,ef21=false"]))
    assert not (t.error_feedback or t.ef21 or t.ef21_damping or t.guard_ratio)
    assert t.quant_format == tagc_hook.TAGCConfig.from_yaml(balanced).quant_format
    with pytest.raises(ValueError, match="dense_stepz"):  # TAGCConfig: unknown field
        load_tagc_config(tagc_hook, parse_config(
            ["--tagc", preset, "--tagc_set", "dense_stepz=5"]))
    with pytest.raises(ValueError, match="^dense_steps"):  # TAGCConfig: bad value
        load_tagc_config(tagc_hook, parse_config(
            ["--tagc", preset, "--tagc_set", "dense_steps=-1"]))
    for bad in (["--tagc_set", "dense_steps=5"],                      # no --tagc
                ["--tagc", preset, "--tagc_set", "dense_steps"],       # no '='
                ["--tagc", preset, "--tagc_set", "theta=0.9,theta=0.8"]):
        with pytest.raises(ValueError, match="tagc_set"):
            parse_config(bad)


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = parse_config(["--warmup_iters=10", "--max_iters=110",
                                   "--learning_rate=1.0", "--min_lr=0.1"])
    lrs = [get_lr(i, cfg) for i in range(120)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))          # warmup rises
    assert lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))     # cosine falls
    assert lrs[60] == pytest.approx(0.55)
    assert lrs[115] == pytest.approx(0.1)


def test_model_layout_and_sizes() -> None:
    """Names the hook's non_attention policy relies on; GPT-2 small has 124M parameters."""
    m = gpt_model.GPT(gpt_model.GPTConfig(block_size=16, vocab_size=320, n_layer=1,
                                            n_head=2, n_embd=32))
    names = {n for n, _ in m.named_modules()}
    assert {"transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
            "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "lm_head"} <= names
    assert m.lm_head.weight is m.transformer.wte.weight
    logits, loss = m(torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    assert logits.shape == (2, 16, 320) and loss.ndim == 0
    with torch.device("meta"):
        assert gpt_model.GPT(gpt_model.GPTConfig()).num_params() == 124_475_904


# --------------------------------------------------------------------------- data

def test_stdlib_preparation_is_deterministic(tmp_path: Path, cache_dir: Path) -> None:
    tok = token_data.byte_tokenizer()
    src = token_data.get_source("stdlib")
    assert token_data.list_files(token_data.stdlib_root(), ".py") == \
        token_data.list_files(token_data.stdlib_root(), ".py")
    meta_a = token_data.prepare(src, tok, tmp_path)
    meta_b = token_data.prepare(token_data.get_source("stdlib"), tok, cache_dir)
    for split in ("train", "val"):
        digest = [hashlib.sha256(Path(m[split]).read_bytes()).hexdigest()
                  for m in (meta_a, meta_b)]
        assert digest[0] == digest[1], split
    assert 0 < meta_a["tokens"]["val"] < meta_a["tokens"]["train"]
    # the split is a property of each file's name, not of the file list
    assert token_data._in_val("json/decoder.py", 5.0) == token_data._in_val("json/decoder.py", 5.0)
    # batches are a pure function of their key
    data = token_data.TokenData(meta_a)
    x1, y1 = data.get_batch("train", 4, 16, (1, 2, 3))
    x2, y2 = data.get_batch("train", 4, 16, (1, 2, 3))
    assert torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])
    assert not torch.equal(x1, data.get_batch("train", 4, 16, (1, 2, 4))[0])


def test_folder_source_and_split(tmp_path: Path) -> None:
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(60):
        (root / f"doc{i:02d}.txt").write_text(f"document {i} " * 20)
    meta = token_data.prepare(token_data.get_source(str(root), val_percent=20.0),
                             token_data.byte_tokenizer(), tmp_path / "cache")
    counts = meta["tokens"]
    assert counts["val"] > 0 and counts["train"] > counts["val"]
    raw = Path(meta["train"]).read_bytes()
    assert len(raw) == 2 * counts["train"]  # uint16
    with pytest.raises(FileNotFoundError):
        token_data.get_source(str(tmp_path / "missing"))


def test_tokenizer_falls_back_offline_without_waiting(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache: BPE missing
    t0 = time.monotonic()
    tok = token_data.get_tokenizer("auto")
    assert time.monotonic() - t0 < 10
    assert tok.name == "byte" and tok.encode("hé") == [104, 195, 169]
    with pytest.raises(RuntimeError, match="not cached"):
        token_data.get_tokenizer("gpt2")


def test_openwebtext_offline_error_says_how_to_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    with pytest.raises(RuntimeError, match="--data openwebtext needs"):
        token_data.get_source("openwebtext")


# --------------------------------------------------------------------------- 2-rank runs

def _run_mains(rank: int, world: int, argvs: List[List[str]]) -> List[Dict[str, Any]]:
    return [main(argv) for argv in argvs]


def _base(tmp: Path, cache: Path, name: str, *extra: str) -> List[str]:
    return [f"--out_dir={tmp / name}", f"--cache_dir={cache}", *FAST, *extra]


@pytest.mark.dist
@pytest.mark.slow
def test_two_rank_baseline_fsdp1_and_fsdp2(tmp_path: Path, cache_dir: Path) -> None:
    runs = [_base(tmp_path, cache_dir, "b1", "--fsdp=1", "--max_iters=4", "--grad_accum=2"),
            _base(tmp_path, cache_dir, "b2", "--fsdp=2", "--max_iters=4",
                  "--sharding=SHARD_GRAD_OP", "--save_checkpoint=false")]
    res = run_dist(_run_mains, 2, runs, timeout=240)
    for name, s in zip(("b1", "b2"), res[0]):
        assert s["iters"] == 4 and s["world_size"] == 2
        assert s["final_val_loss"] < 5.4  # ln(257) = 5.55 at initialisation
        assert s["saved_pct"] == 0 and s["bits_per_param"] == pytest.approx(16.0)
        rows = (tmp_path / name / "metrics.csv").read_text().splitlines()
        assert rows[0].startswith("kind,iter,loss") and len(rows) == 1 + 2 + 2  # 2 val, 2 train
        assert json.loads((tmp_path / name / "summary.json").read_text())["iters"] == 4
    assert (choose(tmp_path / "b1" / "ckpt", "latest") / "train_state.json").exists()
    assert not (tmp_path / "b2" / "ckpt").exists()
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return
    assert any((tmp_path / "b1" / "tb").iterdir())


@needs_tagc
@pytest.mark.dist
@pytest.mark.slow
def test_two_rank_tagc_presets_fsdp1_and_fsdp2(tmp_path: Path, cache_dir: Path) -> None:
    runs = [_base(tmp_path, cache_dir, "e1", "--fsdp=1", "--max_iters=4",
                  f"--tagc={PRESETS / 'tagc-exact.yaml'}", "--save_checkpoint=false"),
            _base(tmp_path, cache_dir, "s2", "--fsdp=2", "--max_iters=4", "--grad_accum=2",
                  f"--tagc={PRESETS / 'tagc-sparse.yaml'}", "--save_checkpoint=false"),
            _base(tmp_path, cache_dir, "b2", "--fsdp=2", "--max_iters=4",
                  f"--tagc={PRESETS / 'tagc-balanced.yaml'}", "--save_checkpoint=false"),
            _base(tmp_path, cache_dir, "f2", "--fsdp=2", "--max_iters=4",
                  f"--tagc={PRESETS / 'tagc-full.yaml'}", "--save_checkpoint=false")]
    res = run_dist(_run_mains, 2, runs, timeout=240)
    for s in res[0]:
        assert s["iters"] == 4 and s["final_val_loss"] < 5.4
        assert 0 < s["bytes_sent"] < s["bytes_uncompressed"]
        assert 0 < s["compressed_bits_per_param"] < 16  # 16 uncompressed at N=2
        assert s["unpeeled"] == s["recovered"]  # exact mode recovers what peeling left
    # the sparse preset: k (offset, value) pairs per shard -> (N-1)/N * 64 * (1-theta)
    assert res[0][1]["compressed_bits_per_param"] == pytest.approx(0.4, rel=0.05)
    # tagc-balanced: int4 codes + an fp32 scale per 64 -> (N-1)/N * (4 + 32/64)
    assert res[0][2]["compressed_bits_per_param"] == pytest.approx(2.25, rel=0.01)
    # tagc-full: the same gradients, and int8 parameter gathers (8 + 32/256 bits per
    # padded parameter instead of 32): a quarter of the plain gathers, give or take
    # the blocks cut short at each parameter's end
    full = res[0][3]
    assert full["compressed_bits_per_param"] == pytest.approx(2.25, rel=0.01)
    assert full["gather_bytes_sent"] / full["gather_bytes_uncompressed"] == \
        pytest.approx(8.125 / 32, rel=0.02)
    # the feedback state each rank keeps, per parameter of the model: every preset's
    # budget is one byte (issue 42); the top-k ones keep their residual on int8 codes
    for s in res[0]:
        assert 0 < s["feedback_bytes_per_param"] <= 1.0
    assert res[0][2]["gather_bytes_sent"] == 0


def _flat(d: Dict[str, Any], prefix: str = "") -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[prefix + k] = v
    return out


# FSDP1 and FSDP2 each with a stateful preset, plus plain FSDP (no TAGC state at all).
# The other pairings add no script-side path; they cost ~20 s each on 2 busy cores.
RESUME_CASES = [("1", "tagc-exact.yaml"), ("2", "tagc-sparse.yaml"), ("1", "tagc-balanced.yaml"),
                ("2", None), ("2", "tagc-full.yaml")]


@needs_tagc
@pytest.mark.dist
@pytest.mark.slow
def test_resume_is_bit_exact(tmp_path: Path, cache_dir: Path) -> None:
    """6 steps straight == 3 steps, checkpoint, new processes, resume, 3 steps (bitwise)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    cases = RESUME_CASES
    first, second = [], []
    for fsdp, preset in cases:
        tag = f"f{fsdp}-{preset or 'plain'}"
        common = [f"--fsdp={fsdp}", "--lr_decay_iters=6", "--warmup_iters=2", "--grad_accum=2"]
        if preset:
            common.append(f"--tagc={PRESETS / preset}")
        first.append(_base(tmp_path, cache_dir, f"{tag}-straight", "--max_iters=6", *common))
        first.append(_base(tmp_path, cache_dir, f"{tag}-split", "--max_iters=3", *common))
        second.append(_base(tmp_path, cache_dir, f"{tag}-split", "--max_iters=6",
                            "--init_from=resume", *common))
    run_dist(_run_mains, 2, first, timeout=300)
    run_dist(_run_mains, 2, second, timeout=300)  # fresh processes
    for fsdp, preset in cases:
        tag = f"f{fsdp}-{preset or 'plain'}"
        full, nested = {}, {}
        for kind in ("straight", "split"):
            ckpt = choose(tmp_path / f"{tag}-{kind}" / "ckpt", "latest")
            dcp_to_torch_save(ckpt, tmp_path / f"{tag}-{kind}.pt")
            nested[kind] = torch.load(tmp_path / f"{tag}-{kind}.pt", weights_only=False)
            full[kind] = _flat(nested[kind])
            assert json.loads((ckpt / "train_state.json").read_text())["iter_num"] == 6
        # every tensor (model, optimizer, and each rank's TAGC residual row) bit-equal
        assert sorted(full["straight"]) == sorted(full["split"])
        assert any(k.startswith("optim.state.") for k in full["split"]), tag
        for k, v in full["straight"].items():
            assert torch.equal(v, full["split"][k]), f"{tag}: {k} differs after resume"
        if preset is None:
            assert "tagc" not in nested["split"]
            continue
        rows = [v for k, v in full["split"].items()
                if k.startswith("tagc.units.") and k.endswith(".residual")]
        assert rows and all(v.shape[0] == 2 and bool(v[0].any()) and bool(v[1].any())
                            for v in rows), tag
        assert nested["split"]["tagc"]["rank"].tolist() == [0, 1]
        for name, u in nested["straight"]["tagc"]["units"].items():
            v = nested["split"]["tagc"]["units"][name]
            assert (u["step"], u.get("has_residual")) == (v["step"], v.get("has_residual"))


@needs_tagc
@pytest.mark.dist
@pytest.mark.slow
def test_local_steps_resume_mid_round_is_bit_exact(tmp_path: Path, cache_dir: Path) -> None:
    """Local steps (tagc-local, 2 replicas of one rank, a round of 2 steps): 5 steps
    straight == 3 steps (checkpoint in the middle of a round), new processes, resume,
    2 steps; each replica's model and optimizer state under its own key (DCP would
    keep one copy of a key both replicas wrote), and the two differ mid-round."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    common = ["--fsdp=2", "--replicas=2", "--lr_decay_iters=5", "--warmup_iters=2",
              f"--tagc={PRESETS / 'tagc-local.yaml'}", "--tagc_set=outer_every=2,min_numel=4096"]
    run_dist(_run_mains, 2, [_base(tmp_path, cache_dir, "straight", "--max_iters=5", *common),
                             _base(tmp_path, cache_dir, "split", "--max_iters=3", *common)],
             timeout=300)
    run_dist(_run_mains, 2, [_base(tmp_path, cache_dir, "split", "--max_iters=5",
                                   "--init_from=resume", *common)], timeout=300)
    full = {}
    for kind in ("straight", "split"):
        dcp_to_torch_save(choose(tmp_path / kind / "ckpt", "latest"), tmp_path / f"{kind}.pt")
        full[kind] = _flat(torch.load(tmp_path / f"{kind}.pt", weights_only=False))
    assert sorted(full["straight"]) == sorted(full["split"])
    for k, v in full["straight"].items():
        assert torch.equal(v, full["split"][k]), f"{k} differs after resume"
    mine = {k[len("replica0."):]: v for k, v in full["split"].items()
            if k.startswith("replica0.model.")}
    theirs = {k[len("replica1."):]: v for k, v in full["split"].items()
              if k.startswith("replica1.model.")}
    assert mine and sorted(mine) == sorted(theirs)
    # step 5 is one step into the third round: the replicas have moved apart
    assert any(not torch.equal(v, theirs[k]) for k, v in mine.items())
    assert any(k.startswith("tagc.units.") and k.endswith(".outer_start")
               for k in full["split"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_tagc
@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_command_line(tmp_path: Path, cache_dir: Path) -> None:
    """The README's command, shortened: torchrun, 2 processes, gloo, a TAGC preset."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           str(REPO / "scripts" / "train_gpt2.py"), "--tagc", str(PRESETS / "tagc-exact.yaml"),
           *_base(tmp_path, cache_dir, "cli", "--max_iters=2", "--save_checkpoint=false")]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tokenizer: byte" in p.stdout
    assert "final: iter 2, val loss" in p.stdout and "saved" in p.stdout
    # the run's last line: TAGCState.summary(), once (rank 0)
    assert len(re.findall(r"^TAGC .*tagc-exact\.yaml: \d+/\d+ units compressed", p.stdout,
                          re.M)) == 1, p.stdout[-2000:]
