"""tinker-broker's torch engine: protocol v1 of docs/engine-protocol.md over stdin/stdout."""

PROTOCOL_VERSION = 1
