"""The verl training engine: protocol 2's training ops over verl's FSDP engine (docs/engines/verl.md).

``translate`` (Tinker datums <-> verl batches, the loss verl calls) needs only torch; ``engine`` and
``__main__`` need verl and run under torchrun on GPUs.
"""
