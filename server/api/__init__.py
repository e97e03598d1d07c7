"""The HTTP side of the serving pod: aiohttp app, OpenAI endpoints, SSE, server lifecycle."""
