"""deploy/nginx/wsinfer.conf, run by Debian's nginx on local ports for tests."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from tests.ports import free_ports

CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "wsinfer.conf"


class NginxProxy:
    """The deploy config with local upstreams, ports and a self-signed certificate."""

    def __init__(self, state: Path, upstreams: list[int]) -> None:
        self.state = state
        self.upstreams = upstreams
        self.http_port, self.tls_port = free_ports(2, exclude=upstreams)
        self.process: subprocess.Popen[bytes] | None = None
        self._certificate()
        site = CONF.read_text()
        for i, port in enumerate(upstreams, start=1):
            site = site.replace(f"server frontend{i}:8000", f"server 127.0.0.1:{port}")
        site = site.replace("listen [::]:80;", "").replace("listen [::]:443 ssl;", "")
        site = site.replace("listen 80;", f"listen 127.0.0.1:{self.http_port};")
        site = site.replace("listen 443 ssl;", f"listen 127.0.0.1:{self.tls_port} ssl;")
        site = site.replace("/etc/nginx/certs", str(state))
        (state / "site.conf").write_text(site)
        temp = " ".join(
            f"{kind}_temp_path {state}/{kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        (state / "nginx.conf").write_text(
            f"pid {state}/nginx.pid;\nerror_log {state}/error.log warn;\n"
            f"events {{}}\nhttp {{ access_log off; {temp} include {state}/site.conf; }}\n"
        )

    def _certificate(self) -> None:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
            + ["-subj", "/CN=localhost", "-keyout", str(self.state / "tls.key")]
            + ["-out", str(self.state / "tls.crt")],
            check=True,
            capture_output=True,
        )

    def _command(self, *extra: str) -> list[str]:
        return ["nginx", "-p", str(self.state), "-c", str(self.state / "nginx.conf"), *extra]

    def check(self) -> str:
        """``nginx -t``: empty if the config is good, else nginx's complaint."""
        done = subprocess.run(self._command("-t"), capture_output=True, text=True)
        return "" if done.returncode == 0 else done.stderr

    def start(self) -> None:
        self.process = subprocess.Popen(
            self._command("-g", "daemon off;"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.tls_port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError("nginx did not start; see error.log")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
