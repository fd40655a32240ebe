"""wsinfer.engine."""
