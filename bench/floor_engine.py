"""The engine of bench/floor.ts: reads one JSON line per op from stdin, keeps the CPU busy with torch
for the op's `ms` (as the tiny model's forward_backward and optim_step do), and answers one JSON line."""
import json
import sys
import time

import torch


def main() -> None:
    a = torch.randn(192, 192)
    for line in sys.stdin:
        op = json.loads(line)
        t0 = time.time() * 1000
        while time.time() * 1000 - t0 < op["ms"]:
            a = torch.tanh(a @ a) * 0.5
        sys.stdout.write(json.dumps({"id": op["id"]}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
