"""Entry point: ``python -m tinker_engine`` speaks protocol 2 on stdin/stdout, logs on stderr.

File descriptor 1 is reserved for reply frames: at start-up the engine keeps a private duplicate
of it for the channel and points fd 1 (and ``sys.stdout``) at stderr, so a stray ``print`` or a
library writing to stdout can never corrupt the framing.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Local directories only: never reach a model hub. Set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .channel import claim_stdio  # noqa: E402 - standard library only


def main() -> int:
    protocol_in, protocol_out = claim_stdio()

    from transformers.utils import logging as hf_logging

    from .channel import Channel
    from .device import placement_from_env
    from .engine import Engine
    from .server import serve

    hf_logging.disable_progress_bar()
    # Deprecation notices from transformers/PEFT internals would repeat on every op.
    warnings.filterwarnings("ignore", category=FutureWarning)
    placement = placement_from_env()
    logging.getLogger("tinker_engine").info("engine start pid=%d device=%s dtype=%s", os.getpid(),
                                            placement.device_name, placement.dtype)
    return serve(Channel(protocol_in, protocol_out), Engine(placement))


if __name__ == "__main__":
    sys.exit(main())
