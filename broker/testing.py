"""Helpers for tests that need a real broker process on loopback.

    proc, address = start_broker(tmp_path, rows=16, group_size=2, batch_groups=4)
    try:
        ...  # AsyncBrokerClient(address) / BrokerClient(address)
    finally:
        stop(proc)

``rows`` is a list of verl-format rows or a count of synthetic ones; keyword arguments are ``broker.*``
settings (nested ones as dicts: ``journal={"fsync": "always"}``). The journal lives in
``tmp_path/journal`` so a restart with the same ``tmp_path`` and ``port`` resumes the same broker.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from tidal.broker.types import Group, PromptGroup, Sample
from tidal.procs import free_port, python_cmd, spawn, tail, wait_for_tcp


def synthetic_rows(n: int) -> list[dict[str, Any]]:
    """``n`` verl-format rows of two-number additions."""
    return [
        {
            "data_source": "synthetic/add",
            "prompt": [{"role": "user", "content": f"{i} + {i + 1} = ?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


def write_rows(path: Path, rows: list[dict[str, Any]] | int) -> Path:
    rows = synthetic_rows(rows) if isinstance(rows, int) else rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _flatten(prefix: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [o for k, v in value.items() for o in _flatten(f"{prefix}.{k}", v)]
    return [f"{prefix}={json.dumps(value)}"]


def start_broker(
    tmp_path: str | Path,
    rows: list[dict[str, Any]] | int = 64,
    *,
    port: int | None = None,
    timeout_s: float = 60.0,
    **broker_settings: Any,
) -> tuple[subprocess.Popen, str]:
    """Start ``tidal broker`` on ``127.0.0.1:port`` (a free one by default); returns (process, address).

    Writes the rows to ``tmp_path/data.jsonl`` unless that file exists (a restart keeps the data), logs to
    ``tmp_path/broker.log``, and returns once the broker listens. The caller stops it (``tidal.procs.stop``).
    """
    tmp_path = Path(tmp_path)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_rows(data, rows)
    port = port or free_port()
    address = f"tcp://127.0.0.1:{port}"
    overrides = [f"run_dir={tmp_path}", f"broker.bind={address}", f"broker.data.path={data}"]
    for key, value in broker_settings.items():
        overrides += _flatten(f"broker.{key}", value)
    log = tmp_path / "broker.log"
    proc = spawn(python_cmd("broker", *overrides), log_path=log)
    try:
        wait_for_tcp("127.0.0.1", port, timeout_s=timeout_s, proc=proc)
    except Exception as exc:
        from tidal.procs import stop

        stop(proc)
        raise RuntimeError(f"broker did not start: {exc}\n--- {log}:\n{tail(log)}") from None
    return proc, address


def make_curve_keys(directory: str | Path, clients: tuple[str, ...] = ("node", "trainer")) -> dict[str, Path]:
    """Key pairs for a broker and ``clients`` in ``directory/keys``, the clients' public keys allowed in
    ``directory/allowed``: ``{name: public, name_secret: secret, "allowed": dir}``."""
    from tidal.broker.curve import create_keys

    directory = Path(directory)
    keys = {"allowed": directory / "allowed"}
    keys["allowed"].mkdir(parents=True)
    for name in ("broker", *clients):
        keys[name], keys[f"{name}_secret"] = create_keys(directory / "keys", name)
        if name != "broker":
            shutil.copy(keys[name], keys["allowed"])
    return keys


def fake_group(
    pg: PromptGroup, version: int = 0, response_len: int = 4, rewards: list[float] | None = None
) -> Group:
    """A scored group for ``pg`` as a rollout node would submit it, every token stamped ``version``."""
    rewards = rewards if rewards is not None else [float(i % 2) for i in range(pg.n)]
    samples = [
        Sample(
            prompt_ids=np.arange(3, dtype=np.int32),
            response_ids=np.arange(response_len, dtype=np.int32) + i,
            logprobs=np.full(response_len, -0.5, np.float32),
            versions=np.full(response_len, version, np.int32),
            reward=rewards[i],
            finish_reason="stop",
            meta={"i": i},
        )
        for i in range(pg.n)
    ]
    return Group(group_id=pg.group_id, samples=samples, meta={"row": pg.row.index})
