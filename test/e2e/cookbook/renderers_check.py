"""Do the cookbook's renderers work with a model's tokenizer loaded from its local directory?

    python test/e2e/cookbook/renderers_check.py [model_dir] [renderer ...]

For each renderer (default: role_colon and the Qwen3 family) it loads the tokenizer as the
recipes do (``tokenizer_utils.get_tokenizer(<dir>)``), builds a supervised example and a
generation prompt, and checks:

- ``ok``: neither raises (qwen3_disable_thinking raises if the prompt it writes is not a prefix of
  the example it writes, which happens when ``<think>`` does not encode as one token);
- ``prompt_matches_template`` (qwen3, qwen3_disable_thinking): the generation prompt's tokens equal the tokenizer's
  own chat template's (``apply_chat_template(..., add_generation_prompt=True,
  enable_thinking=...)``);
- ``example_matches_template`` (qwen3, qwen3_disable_thinking): the supervised example equals the chat template's
  rendering of the whole conversation (without its final newline);
- ``think_tokens_single`` (renderers that write think blocks): ``<think>`` and ``</think>`` appear
  in the example as the tokenizer's single tokens, not spelled out byte by byte;
- ``parse_roundtrip``: parsing a reply written as the model would write it gives the message back.

Prints one JSON object: ``{renderer: {check: bool | str}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_RENDERERS = ["role_colon", "qwen3", "qwen3_disable_thinking", "qwen3_instruct"]
CONVO = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "What is 40 + 2?"},
    {"role": "assistant", "content": "The answer is 42."},
]


def _ids(x) -> list[int]:
    if hasattr(x, "keys"):
        x = x["input_ids"]
    return list(x)


def check(tokenizer, name: str) -> dict:
    out: dict = {}
    try:
        r = renderers.get_renderer(name, tokenizer)
        example, _weights = r.build_supervised_example(CONVO)
        ids = example.to_ints()
        prompt = r.build_generation_prompt(CONVO[:-1]).to_ints()
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    # The tiny model's template is the hybrid Qwen3 one (thinking on or off); qwen3_instruct
    # renders the 2507 instruct models' template, which has no think blocks at all.
    if name in ("qwen3", "qwen3_disable_thinking") and getattr(tokenizer, "chat_template", None):
        thinking = name == "qwen3"
        tpl_prompt = tokenizer.apply_chat_template(CONVO[:-1], tokenize=False, add_generation_prompt=True,
                                                   enable_thinking=thinking)
        out["prompt_matches_template"] = prompt == tokenizer.encode(tpl_prompt, add_special_tokens=False)
        tpl_full = tokenizer.apply_chat_template(CONVO, tokenize=False, enable_thinking=thinking)
        out["example_matches_template"] = ids == tokenizer.encode(tpl_full.rstrip("\n"), add_special_tokens=False)
    if name in ("qwen3", "qwen3_disable_thinking"):
        think = tokenizer.convert_tokens_to_ids("<think>")
        end_think = tokenizer.convert_tokens_to_ids("</think>")
        out["think_tokens_single"] = think in ids and end_think in ids
    stop = r.get_stop_sequences()
    reply = "The answer is 42."
    if name == "role_colon":
        reply_ids = tokenizer.encode(reply + stop[0], add_special_tokens=False)
    else:
        prefix = "<think>\n\n</think>\n\n" if name.startswith("qwen3") and name != "qwen3_instruct" else ""
        reply_ids = tokenizer.encode(prefix + reply, add_special_tokens=False) + [stop[0]]
    msg, _term = r.parse_response(reply_ids)
    content = msg["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content if p["type"] == "text")
    out["parse_roundtrip"] = text.strip() == reply
    return out


def main(argv: list[str]) -> None:
    model = argv[0] if argv else str(ROOT / "models/tiny-qwen3")
    names = argv[1:] or DEFAULT_RENDERERS
    tokenizer = get_tokenizer(str(Path(model).resolve()))
    print(json.dumps({n: check(tokenizer, n) for n in names}))


if __name__ == "__main__":
    main(sys.argv[1:])
