"""wsinfer.sessions."""
