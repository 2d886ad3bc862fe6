"""Start `verispec serve` in a subprocess on a free loopback port and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CommandServer:
    """Any server command (e.g. `python -m llama_cpp.server`) on a free loopback port: `argv` may contain
    '{port}'; ready once GET `ready_path` answers 200."""

    def __init__(self, argv: list[str], ready_path: str = "/v1/models", timeout: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([a.replace("{port}", str(self.port)) for a in argv],
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + ready_path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start in time")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ServerProcess(CommandServer):
    """`verispec serve ARGS` on a free loopback port, offline; ready once /health answers."""

    def __init__(self, args: list[str], timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "verispec.apps.cli", "serve", "--port", "{port}", "--log-level", "warning", *args]
        super().__init__(argv, "/health", timeout, {"HF_HUB_OFFLINE": "1", **(env or {})})


def metric(url: str, name: str, labels: str = "") -> float:
    """The value of one Prometheus sample (`name{labels}`) on the server's /metrics, 0 when absent."""
    sample = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def series_count(url: str) -> int:
    """Number of samples /metrics exposes (each label set of each metric counts)."""
    return sum(1 for line in httpx.get(url + "/metrics").text.splitlines() if line and not line.startswith("#"))
