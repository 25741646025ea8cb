"""tinker-broker's torch engine: protocol v2 of docs/engine-protocol.md over stdin/stdout."""

PROTOCOL_VERSION = 2
