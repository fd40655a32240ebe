"""The README's resume-after-a-restart example, run as written (two processes) against
a real frontend, Redis and (fake-model) engine: the second process prints exactly what
the first did not, then a second turn of the same conversation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.stack import Stack

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "client.attach" in b]
    return block


def test_the_readme_resumes_a_turn_in_a_new_process(redis_url: str, tmp_path: Path) -> None:
    # The fake engine's token text is its production time in µs, and 100 tokens/s is
    # slow enough that the turn is still running when the first process leaves.
    stack = Stack(redis_url, "fake:100:stamp")
    try:
        stack.start_engine("e1")
        _, port = stack.start_frontend()
        script = tmp_path / "example.py"
        script.write_text(readme_example().replace("127.0.0.1:8000", f"127.0.0.1:{port}"))

        def run(*args: str) -> str:
            return subprocess.run(
                [sys.executable, str(script), *args],
                cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True,
            ).stdout  # fmt: skip

        first = run()
        saved = (tmp_path / "turn.json").read_text()
        second = run("--resume")
    finally:
        stack.stop()
    text = json.loads(saved)["text"]
    assert text.startswith(first) and second.startswith(text)
    stamps = re.findall(r"\d+", second)
    # One stamp per token (tokens of one engine step share it): a lost or repeated
    # delta changes the count, one out of place breaks the order.
    assert len(stamps) == 200 + 50, len(stamps)
    answer = [int(s) for s in stamps[:200]]
    assert answer == sorted(answer)
