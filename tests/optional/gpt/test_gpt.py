"""model=gpt: shapes, causality, the tied head, the empty micro-batch, the refusals, a tiny
model that learns, torch.compile (Inductor) equal to eager, and
``ddp_template.optional.gpt.sample`` on a checkpoint laid out as a run writes it."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import PY, run, train_cmd
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn import functional as F

from ddp_template.checkpoint import FORMAT_VERSION
from ddp_template.errors import EXIT_CONFIG_ERROR, ConfigError
from ddp_template.optional.gpt import sample
from ddp_template.optional.gpt.model import GPT, gpt
from ddp_template.optional.tokens.file import TokenMeta, write_tokens

pytestmark = pytest.mark.needs("tokens")  # the GPT learns from token files

V, BLOCK = 64, 16
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32}  # the learning test's and the sampled run's
TEXT = b"hello world! " * 20


def small(**kw: object) -> GPT:
    torch.manual_seed(0)
    sizes = {"vocab_size": V, "block_size": BLOCK, "n_layer": 2, "n_head": 2, "n_embd": 32}
    return gpt(**sizes | kw)


def ids(b: int, t: int = BLOCK, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_for_any_length_up_to_block_size() -> None:
    model = small()
    assert model(ids(3)).shape == (3, BLOCK, V)
    assert model(ids(2, 5)).shape == (2, 5, V)


def test_a_token_changes_no_logits_before_it() -> None:
    model = small().eval()
    x = ids(2)
    t = 9
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % V
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_head_is_tied_to_the_token_embedding_and_counted_once() -> None:
    model = small()
    assert model.lm_head.weight is model.wte.weight
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1
    assert len({id(p) for p in params}) == len(params)
    assert model.lm_head.bias is None


def test_nanogpt_initialisation() -> None:
    model = small(n_layer=4, n_embd=128, n_head=4)
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.blocks])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 4), rel=0.05)
    assert model.blocks[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert not any(isinstance(m, nn.Linear) and m.bias is not None for m in model.modules())
    assert small(bias=True).blocks[0].attn.c_attn.bias.abs().sum() == 0


def test_same_seed_same_model_same_logits() -> None:
    a, b = small(), small()
    x = ids(2)
    assert torch.equal(a(x), b(x))
    assert torch.equal(a(x), a(x))


def test_an_empty_micro_batch_has_empty_logits_and_a_backward() -> None:
    model = small()
    out = model(ids(3)[:0])
    assert out.shape == (0, BLOCK, V)
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"vocab_size": None}, "data=tokens sets them, or set model.vocab_size"),
        ({"block_size": None}, "set model.vocab_size and model.block_size"),
        ({"n_embd": 30, "n_head": 4}, "model.n_embd=30 is not divisible by model.n_head=4"),
        ({"n_layer": 0}, "model.n_layer=0 must be >= 1"),
        ({"vocab_size": 0}, "model.vocab_size=0 must be >= 1"),
        ({"n_head": -2}, "model.n_head=-2 must be >= 1"),
        ({"dropout": 1.0}, "model.dropout=1.0 is outside [0, 1)"),
        ({"dropout": -0.1}, "model.dropout=-0.1 is outside [0, 1)"),
    ],
)
def test_bad_sizes_are_refused_in_one_sentence(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        small(**kwargs)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_a_sequence_longer_than_block_size_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        small()(ids(1, BLOCK + 1))
    message = str(exc.value)
    assert "17 tokens is longer than model.block_size=16" in message and "\n" not in message


def _windows(g: torch.Generator, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    text = torch.tensor(list(TEXT))
    starts = torch.randint(0, len(text) - BLOCK - 1, (batch,), generator=g).tolist()
    w = torch.stack([text[s : s + BLOCK + 1] for s in starts])
    return w[:, :-1], w[:, 1:]


@pytest.fixture(scope="module")
def learned() -> tuple[GPT, float]:
    """A tiny byte-level model after 100 AdamW steps on a repeated phrase, and its last loss."""
    torch.manual_seed(0)
    model = gpt(vocab_size=256, block_size=BLOCK, **TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        x, y = _windows(g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), loss.item()


def test_a_tiny_model_learns_a_repeated_phrase(learned: tuple[GPT, float]) -> None:
    _, loss = learned
    assert loss < 0.5, loss  # from ln(256) = 5.5 nats


def test_the_whole_model_compiles_as_one_graph_with_the_eager_logits() -> None:
    """``fullgraph=True``: Dynamo captures the forward without a graph break (the part of
    ``compile=true`` the model decides); AOT autograd's backend, not Inductor's code generation
    (~15 s cold on 2 cores, torch's own and proven on the default model by test_compile.py)."""
    torch._dynamo.reset()
    model = small(n_layer=1).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = ids(2)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-5)
    assert compiled(x[:0]).shape == (0, BLOCK, V)


def _run(root: Path, compose: Callable[..., DictConfig], model: nn.Module, *overrides: str) -> Path:
    """A checkpoint as a run writes it: the run's config and the weights (nothing else of the
    run dir is needed to sample)."""
    run_dir = root / "run"
    cfg = compose(*overrides)
    payload = {
        "format": FORMAT_VERSION,
        "config": OmegaConf.to_yaml(cfg),
        "world_size": 1,
        "ranks": [{}],
        "model": model.state_dict(),
    }
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save(payload, run_dir / "checkpoints" / "last.pt")
    return run_dir / "checkpoints" / "last.pt"


def _lm_run(root: Path, compose: Callable[..., DictConfig], model: nn.Module) -> Path:
    tokens = root / "tokens"
    meta = TokenMeta("uint16", 256, "bytes", {})
    arr = np.frombuffer(TEXT, dtype=np.uint8)
    write_tokens(tokens, "val.bin", arr, write_tokens(tokens, "train.bin", arr, meta))
    model_keys = [f"model.{k}={v}" for k, v in TINY.items()]
    lm = ("model=gpt", "data=tokens", "task=lm", "optim=adamw", f"data.path={tokens}")
    return _run(root, compose, model, *lm, f"data.block_size={BLOCK}", *model_keys)


def test_sample_continues_the_prompt_from_a_checkpoint(
    learned: tuple[GPT, float],
    tmp_path: Path,
    compose_cfg: Callable[..., DictConfig],
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = _lm_run(tmp_path, compose_cfg, learned[0])
    args = [str(ckpt), "--prompt", "hello", "--tokens", "40"]
    assert sample.main([*args, "--temperature", "0"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    assert text.startswith("hello") and len(text.encode()) == 5 + 40
    assert text == TEXT.decode()[:45]  # the phrase it learned, greedily

    assert sample.main([*args, "--seed", "3"]) == 0
    assert sample.main([*args, "--seed", "3"]) == 0
    first, second = capsys.readouterr().out.split("\n")[:2]
    assert first == second and first.startswith("hello")

    (tmp_path / "tokens" / "meta.json").write_text(
        (tmp_path / "tokens" / "meta.json").read_text().replace('"bytes"', '"custom"')
    )
    assert sample.main([str(ckpt), "--prompt-ids", "104,101", "--tokens", "7"]) == 0
    out = capsys.readouterr().out.strip().split(",")
    assert len(out) == 2 + 7 and out[:2] == ["104", "101"]
    assert sample.main(args) == EXIT_CONFIG_ERROR
    err = capsys.readouterr().err
    assert "tokens are not bytes; pass the prompt as token ids with --prompt-ids" in err


def test_sample_keys_of_a_wrapped_model_are_unwrapped() -> None:
    state = {"_orig_mod.module.wte.weight": 1, "_orig_mod.module.ln_f.weight": 2}
    assert sample._unwrapped(state) == {"wte.weight": 1, "ln_f.weight": 2}
    assert sample._unwrapped({"module.x": 1, "y": 2}) == {"module.x": 1, "y": 2}


def test_sample_refuses_bad_input_with_exit_2(
    tmp_path: Path, compose_cfg: Callable[..., DictConfig], capsys: pytest.CaptureFixture[str]
) -> None:
    def refused(ckpt: Path, needle: str) -> None:
        assert sample.main([str(ckpt)]) == EXIT_CONFIG_ERROR
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err

    refused(tmp_path / "nothing.pt", "nothing.pt does not exist; pass a checkpoint a run wrote")
    loose = tmp_path / "loose" / "last.pt"
    loose.parent.mkdir()
    torch.save({"format": FORMAT_VERSION, "model": {}}, loose)
    refused(loose, "holds no model weights or no config")
    digits = _run(tmp_path, compose_cfg, small(), "data=digits")
    refused(
        digits, "data._target_=ddp_template.data.builtin.digits, whose data gives no vocabulary"
    )


def test_sample_needs_only_the_checkpoint(tmp_path: Path) -> None:
    """A run's last.pt copied alone to an empty folder samples from another empty working
    directory: what the data told the model is in the checkpoint (``data_info``), so no data
    is rebuilt (no corpus regenerated) and nothing is written."""
    work, alone, elsewhere = tmp_path / "work", tmp_path / "alone", tmp_path / "elsewhere"
    for d in (work, alone, elsewhere):
        d.mkdir()
    model_keys = [f"model.{k}={v}" for k, v in TINY.items()]
    lm = ["model=gpt", "data=corpus", "task=lm", "data.size=20000", f"data.block_size={BLOCK}"]
    cmd = train_cmd(tmp_path, *lm, *model_keys, "epochs=1", "max_steps_per_epoch=2")
    run(cmd, cwd=work)
    (ckpt,) = (tmp_path / "outputs").glob("*/checkpoints/last.pt")
    shutil.copy(ckpt, alone / "last.pt")
    before = sorted(p for d in (alone, elsewhere) for p in d.rglob("*"))
    args = [PY, "-m", "ddp_template.optional.gpt.sample", str(alone / "last.pt")]
    proc = run([*args, "--prompt", "The", "--tokens", "8"], cwd=elsewhere)
    assert proc.stdout.startswith("The") and len(proc.stdout.rstrip("\n").encode()) >= 3 + 8
    assert sorted(p for d in (alone, elsewhere) for p in d.rglob("*")) == before
