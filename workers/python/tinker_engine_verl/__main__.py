"""Entry point of the verl engine: one process per GPU, started by torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node=N -m tinker_engine_verl

Rank 0 speaks protocol 2 (docs/engine-protocol.md) on the stdin/stdout it inherits from torchrun
(the agent's pipes): it reads each request frame and broadcasts it to the other ranks over a gloo
group with no practical timeout (an idle engine waits for hours between requests); every rank then
runs the op, and rank 0 writes the reply. EOF on rank 0's stdin is broadcast as the end: all exit 0.
As in the torch engine, fd 1 is kept for frames only (a duplicate), and fd 1 / ``sys.stdout`` of
every rank point at stderr, so nothing else can corrupt the framing. Run without torchrun, it is a
group of one (rank 0, world size 1).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from datetime import timedelta

from tinker_engine.channel import claim_stdio

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
# verl's platform: its CUDA one, which tinker_engine_verl/cpu.py replaces by a CPU one on CPU ranks.
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init_distributed():  # -> (rank, world_size, control group)
    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:  # not under torchrun: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return rank, world, control


def main() -> int:
    protocol_in, protocol_out = claim_stdio()
    warnings.filterwarnings("ignore", category=FutureWarning)
    import torch.distributed as dist

    from tinker_engine.channel import Channel
    from tinker_engine.engine import reply

    from .engine import VerlEngine

    rank, world, control = _init_distributed()
    log = logging.getLogger("tinker_engine_verl")
    log.info("verl engine start pid=%d rank=%d world_size=%d", os.getpid(), rank, world)
    engine = VerlEngine(rank=rank, world_size=world)
    channel = Channel(protocol_in, protocol_out) if rank == 0 else None
    if rank != 0:
        protocol_out.close()
    try:
        while True:
            box = [channel.read() if channel is not None else None]
            if world > 1:
                dist.broadcast_object_list(box, src=0, group=control)
            body = box[0]
            if body is None:
                log.info("rank %d: channel closed; exiting", rank)
                return 0
            answer = reply(engine.call, body)
            if channel is not None:
                try:
                    channel.write(answer)
                except BrokenPipeError:
                    log.info("stdout closed; exiting")
                    return 0
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


if __name__ == "__main__":
    sys.exit(main())
