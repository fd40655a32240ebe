"""wsinfer.engine: token generation (``EngineCore``) and its Redis process loop.

This folder (``engine/``) installs as ``wsinfer.engine`` (pyproject's
``package-dir``): import it as ``from wsinfer.engine.core import EngineCore``,
never as ``engine``; modules inside import each other relatively.
"""
