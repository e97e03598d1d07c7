"""The serving pod: OpenAI-compatible HTTP server, metrics, and the paged-KV engine (`engine/`)."""
