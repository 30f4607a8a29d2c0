"""Start, watch and restart an engine server process: ``python -m sglang.launch_server`` on GPU nodes.

:class:`EngineProcess` runs any command that serves SGLang's protocol on a port (``sglang_command`` builds
SGLang's from the node's :class:`SGLangEngineConfig`), waits for ``/health``, probes the version through
the client, and restarts the process when it died or stopped answering.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tidal.procs import kill_tree, spawn, stop, tail
from tidal.rollout.config import SGLangEngineConfig
from tidal.rollout.http_client import SGLangClient


def sglang_available() -> bool:
    """SGLang can serve here: the package and its compiled kernels are installed and a GPU is visible."""
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sgl_kernel") is None:
        return False
    import torch

    return torch.cuda.is_available()


def sglang_command(config: SGLangEngineConfig, model_path: str, *, port: int | None = None) -> list[str]:
    """``python -m sglang.launch_server`` with the node's options."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        config.host,
        "--port",
        str(port if port is not None else config.port),
        "--tp-size",
        str(config.tp),
        "--ep-size",
        str(config.ep),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--skip-server-warmup",
        *config.extra_args,
    ]


class EngineProcess:
    def __init__(self, command: list[str], url: str, *, log_path: str | Path, start_timeout_s: float = 600.0):
        self.command = command
        self.url = url
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.client = SGLangClient(url)
        self.restarts = 0

    async def start(self) -> SGLangClient:
        self.proc = spawn(self.command, log_path=self.log_path)
        try:
            await self._wait_ready()
        except Exception:
            self.kill()
            raise
        # the version decides begin/end_weight_update; probe it once per process
        self.client._version_probed = False
        await self.client.version()
        return self.client

    async def _wait_ready(self) -> None:
        import asyncio
        import time

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"engine {self.command[:4]} exited with {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            if await self.client.health():
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(
            f"engine at {self.url} not healthy within {self.start_timeout_s}s; log {self.log_path}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def ensure_alive(self) -> bool:
        """Restart the engine if its process died or /health fails; True when it restarted it."""
        if self.alive() and await self.client.health():
            return False
        self.kill()
        self.restarts += 1
        await self.start()
        return True

    def kill(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc)
            self.proc.wait()

    async def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        await self.client.close()
