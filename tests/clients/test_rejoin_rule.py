"""Which turns a client re-joins after a reconnect: one rule, one table
(rejoin_cases.json), both clients held to every row of it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from wsinfer.clients.protocol import TurnState
from wsinfer.contract import TurnStatus

HERE = Path(__file__).resolve().parent
CASES: list[dict[str, Any]] = json.loads((HERE / "rejoin_cases.json").read_text())["cases"]
WSINFER_JS = HERE.parents[1] / "clients" / "browser" / "wsinfer.js"


def _python_rejoins(case: dict[str, Any]) -> bool:
    turn = TurnState("s1", "k1", 1, status=TurnStatus(case["status"]))
    if case["status"] == "done":
        turn.finish_reason = "stop"
    turn.requested = {asked: None for asked in case["asked"]}
    return turn.live


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['status']}-{'+'.join(c['asked'])}")
def test_the_python_client_follows_the_table(case: dict[str, Any]) -> None:
    assert _python_rejoins(case) is case["rejoins"]


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_the_browser_client_follows_the_table() -> None:
    # The real client: each asked control goes through its _control (queued,
    # pending, on a socket that never opens).
    script = f"""
import {{ WsinferClient, WsinferTurn }} from {json.dumps(str(WSINFER_JS))};
class NeverOpens {{ constructor() {{ this.readyState = 0; }} send() {{}} close() {{}} }}
const storage = {{ getItem: () => null, setItem() {{}}, removeItem() {{}} }};
const cases = {json.dumps(CASES)};
const out = cases.map((c) => {{
  const client = new WsinferClient({{ url: "ws://x/v1/ws", WebSocket: NeverOpens, storage }});
  client.session = "s1";
  client.sessionToken = "k1";
  const turn = new WsinferTurn(client, {{ turn: 1, status: c.status }});
  client.currentTurn = turn;
  for (const type of c.asked) client._control(turn, type);
  return turn.live;
}});
console.log(JSON.stringify(out));
"""
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [case["rejoins"] for case in CASES]
