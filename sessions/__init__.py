"""wsinfer.sessions: session state in Redis, shared by the frontend and the engine.

This folder (``sessions/``) installs as ``wsinfer.sessions`` (pyproject's
``package-dir``): import it as ``from wsinfer.sessions import keys``, never as
``sessions``. ``schema`` holds the turn record both sides share; ``store`` is
the frontend's (asyncio) side and ``worker`` the engine's (sync) side.
"""
