"""``tidal keys DIR NAME [NAME ...]``: create ZeroMQ CURVE key pairs for the broker and its clients.

    tidal keys keys/ broker node0 node1 trainer

writes ``keys/NAME.key`` (public) and ``keys/NAME.key_secret`` for each name. Give the broker
``broker.curve.server_secret_key_file=keys/broker.key_secret`` and put the public ``.key`` files of the
clients it should allow in ``broker.curve.allowed_client_keys_dir``; give each client its own
``.key_secret`` and the broker's public ``broker.key``.
"""

from __future__ import annotations

from tidal.errors import ConfigError


def main(config, args: list[str]) -> int:  # noqa: ARG001 - the run config is not needed to make keys
    if len(args) < 2:
        raise ConfigError("usage: tidal keys DIR NAME [NAME ...]")
    from tidal.broker.curve import create_keys

    directory, names = args[0], args[1:]
    for name in names:
        public, secret = create_keys(directory, name)
        print(f"{name}: public {public}, secret {secret}")
    return 0
