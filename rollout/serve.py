"""``tidal serve [CONFIG.yaml] [key=value ...] [--host H] [--port P]``: the embedded engine over HTTP.

The model comes from ``model`` (a Hugging Face directory when ``model.path`` is set, else randomly
initialised from the config with ``seed``); engine settings from ``rollout.engine`` (type embedded).
It speaks SGLang's native HTTP protocol, so the node agent drives it exactly like an SGLang server.
"""

from __future__ import annotations

import argparse
import sys

from tidal.errors import ConfigError
from tidal.procs import free_port


def parse_args(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tidal serve", description=__doc__)
    parser.add_argument("--host", default=None, help="bind address (default: rollout.engine.host)")
    parser.add_argument(
        "--port", type=int, default=None, help="port (default: rollout.engine.port; 0 picks one)"
    )
    return parser.parse_args(args)


def main(config, args: list[str]) -> int:
    import uvicorn

    from tidal.rollout.embedded.server import create_app
    from tidal.rollout.embedded.service import EmbeddedEngine

    opts = parse_args(args)
    engine_config = config.rollout.engine
    if engine_config.type != "embedded":
        raise ConfigError(
            f"rollout.engine.type={engine_config.type!r}: `tidal serve` runs the embedded engine; "
            "set rollout.engine.type=embedded (an SGLang server is started with sglang.launch_server)"
        )
    host = opts.host or engine_config.host
    port = opts.port if opts.port is not None else engine_config.port
    if port == 0:
        port = free_port(host)
    if engine_config.num_threads is not None:
        import torch

        torch.set_num_threads(engine_config.num_threads)
    engine = EmbeddedEngine(config.model, engine_config, seed=config.seed)
    engine.start()
    app = create_app(engine, host=host, port=port)
    print(
        f"tidal serve: {engine.model_path} on {engine_config.device}, listening on http://{host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        engine.close()
    return 0
