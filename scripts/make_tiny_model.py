#!/usr/bin/env python3
"""Generate the tiny, random-initialised Qwen3 model used by tests and the CPU default.

No hub access: the tokenizer is a byte-level BPE trained here on a corpus this script writes
itself, and the model weights come from a seeded random initialisation. The same arguments give
byte-identical files.

    python scripts/make_tiny_model.py --out models/tiny-qwen3 [--seed 0] [--layers 2] [--hidden 64]

The directory loads offline with ``AutoTokenizer.from_pretrained(dir)`` and
``AutoModelForCausalLM.from_pretrained(dir)``. A ``.complete`` marker is written last; when it is
present and matches the requested arguments the script exits at once (``--force`` rebuilds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Tokenizer training runs on a rayon pool; one thread keeps merges and ids reproducible.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MARKER = ".complete"
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
BPE_VOCAB_SIZE = 1024  # byte alphabet + merges; the special tokens come on top

# Qwen3-style ChatML template (without tool calls): every message is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant turn and,
# with enable_thinking=false, an empty think block as Qwen3 does.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] if message['content'] is string else '' %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines the generated files (recorded in the marker)."""

    seed: int = 0
    layers: int = 2
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 128
    max_positions: int = 2048
    corpus_lines: int = 4000
    bpe_vocab: int = BPE_VOCAB_SIZE
    # 2: <think>/</think> are added tokens that are not special, as in Qwen3, and the chat
    # template writes Qwen3's think block on the last assistant turn (a marker of version 1
    # no longer matches, so existing directories are rebuilt).
    tokenizer_rev: int = 2


_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "the robot", "a student",
             "the farmer", "her brother", "the old man", "a little bird", "the model", "the computer"]
_VERBS = ["sees", "likes", "finds", "reads", "builds", "counts", "writes", "opens", "takes", "moves",
          "learns", "answers", "watches", "helps"]
_OBJECTS = ["the book", "a red ball", "the answer", "three apples", "the door", "a long letter",
            "the small box", "some water", "the garden", "a new song", "the question", "the number"]
_ENDINGS = ["today", "in the morning", "after school", "at night", "every day", "with care",
            "very quickly", "again", "before lunch", "on the table"]
_QUESTIONS = ["What is", "How much is", "Compute", "Tell me", "Please add"]


def corpus(n_lines: int, seed: int = 1234) -> list[str]:
    """A deterministic English + arithmetic corpus; the tokenizer is trained on it."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        kind = i % 5
        if kind == 0:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
            lines.append(s[0].upper() + s[1:])
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = rng.choice(["+", "-", "*"])
            r = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"{a} {op} {b} = {r}")
        elif kind == 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"{rng.choice(_QUESTIONS)} {a} + {b}? The answer is {a + b}.")
        elif kind == 3:
            lines.append(" ".join(str(rng.randint(0, 10_000)) for _ in range(rng.randint(3, 8))))
        else:
            lines.append(f"<|im_start|>user\nWhat is {rng.randint(1, 50)} + {rng.randint(1, 50)}?<|im_end|>\n"
                         f"<|im_start|>assistant\nLet me think. {rng.choice(_SUBJECTS)} knows.<|im_end|>")
    return lines


def build_tokenizer(spec: TinySpec):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(spec.corpus_lines), trainer=trainer)
    # Special tokens after the learned vocabulary, as in Qwen's tokenizer.
    # As in Qwen3's tokenizer: the ChatML markers are special tokens, <think> and </think> are
    # added tokens that are not special (special=False), so decoding with
    # skip_special_tokens keeps them and renderers that split special-token text in content
    # (encode_special_tokens=True) still encode them as one token each.
    from tokenizers import AddedToken
    for t in SPECIAL_TOKENS:
        if t in ("<think>", "</think>"):
            tok.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_positions,
        clean_up_tokenization_spaces=False,
    )


def build_model(spec: TinySpec, vocab_size: int, eos_id: int, pad_id: int):  # -> Qwen3ForCausalLM
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    # Re-draw every parameter from one CPU generator in name order, so the weights depend only
    # on the seed and the shapes, not on module construction order inside transformers.
    gen = torch.Generator(device="cpu").manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * config.initializer_range)
    model.eval()
    return model


def is_complete(out: Path, spec: TinySpec) -> bool:
    marker = out / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == asdict(spec)
    except (OSError, ValueError):
        return False


def make_tiny_model(out: str | os.PathLike[str], spec: TinySpec = TinySpec(), force: bool = False) -> Path:
    """Write the tiny model into ``out`` (skipped if already complete for ``spec``); returns the path."""
    out_path = Path(out).resolve()
    if not force and is_complete(out_path, spec):
        return out_path
    if spec.heads % spec.kv_heads != 0:
        raise ValueError("heads must be a multiple of kv_heads")

    tokenizer = build_tokenizer(spec)
    vocab_size = len(tokenizer)
    model = build_model(spec, vocab_size, eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                        pad_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_path.name + ".tmp-", dir=out_path.parent))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(asdict(spec), sort_keys=True) + "\n")
        if out_path.exists():
            shutil.rmtree(out_path)
        os.replace(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tiny-qwen3", help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size")
    ap.add_argument("--force", action="store_true", help="rebuild even if the output is complete")
    args = ap.parse_args(argv)
    spec = TinySpec(seed=args.seed, layers=args.layers, hidden=args.hidden)
    path = make_tiny_model(args.out, spec, force=args.force)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
