"""The tiny model script: deterministic, complete, and loadable offline by transformers."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import REPO_ROOT


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_tiny_model_loads_with_auto_classes(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen3" and not cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads,
            cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 32, 2, 2, 128)
    assert cfg.vocab_size == len(tok) >= 1000
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert cfg.eos_token_id == tok.eos_token_id
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
    text = "The cat sees 12 + 7 = 19 today."
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2  # merges were learned


def test_same_arguments_give_identical_files(tmp_path: Path, make_tiny: ModuleType, tiny_model_dir: Path) -> None:
    again = make_tiny.make_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)
    other = make_tiny.make_tiny_model(tmp_path / "other", make_tiny.TinySpec(seed=1))
    assert _digest(other)["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(tiny_model_dir)["tokenizer.json"]


def test_cli_skips_a_complete_directory(tiny_model_dir: Path) -> None:
    before = _digest(tiny_model_dir)
    mtime = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    run = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_model.py"), "--out",
                          str(tiny_model_dir)], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == str(tiny_model_dir)
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert _digest(tiny_model_dir) == before
