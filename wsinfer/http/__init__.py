"""The HTTP door: plain HTTP/1.1 (h11) on the WebSocket port, OpenAI-compatible routes."""
