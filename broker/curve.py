"""ZeroMQ CURVE authentication: the broker's key pair and the public keys of the clients it allows.

Keys are ZeroMQ certificate files as written by :func:`zmq.auth.create_certificates` (``NAME.key`` holds the
public key, ``NAME.key_secret`` both). The broker reads its secret certificate from
``broker.curve.server_secret_key_file`` and allows exactly the public certificates in
``broker.curve.allowed_client_keys_dir``; a client without an allowed key never completes the handshake,
so it can neither lease, submit nor fetch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from tidal.broker.config import CurveConfig
from tidal.errors import ConfigError


@dataclass(frozen=True)
class CurveClientKeys:
    public_key: bytes
    secret_key: bytes
    server_public_key: bytes

    @classmethod
    def from_files(cls, client_secret_file: str | Path, server_public_file: str | Path) -> CurveClientKeys:
        public, secret = zmq.auth.load_certificate(client_secret_file)
        if secret is None:
            raise ConfigError(f"{client_secret_file}: not a secret certificate (expected a .key_secret file)")
        server_public, _ = zmq.auth.load_certificate(server_public_file)
        return cls(public, secret, server_public)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key
        sock.curve_serverkey = self.server_public_key


def client_keys(
    secret_key_file: str | None, server_key_file: str | None, prefix: str
) -> CurveClientKeys | None:
    """A client's keys from its config (``PREFIX.curve_secret_key_file`` and ``PREFIX.curve_server_key_file``,
    both or neither: the config models check that); None without CURVE. A missing or wrong file is a
    ConfigError naming the key."""
    if secret_key_file is None or server_key_file is None:
        return None
    for key, path in (("curve_secret_key_file", secret_key_file), ("curve_server_key_file", server_key_file)):
        if not Path(path).is_file():
            raise ConfigError(f"{prefix}.{key}={path!r}: no such file")
    try:
        return CurveClientKeys.from_files(secret_key_file, server_key_file)
    except ConfigError as exc:  # a public certificate where the secret one belongs
        raise ConfigError(f"{prefix}.curve_secret_key_file={secret_key_file!r}: {exc}") from None
    except (ValueError, OSError) as exc:  # not a ZeroMQ certificate
        raise ConfigError(
            f"{prefix}.curve_secret_key_file / curve_server_key_file: not ZeroMQ certificates: {exc}"
        ) from None


def create_keys(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` into ``directory``; returns both paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    return Path(public), Path(secret)


def configure_server(ctx: zmq.asyncio.Context, sock: zmq.Socket, cfg: CurveConfig) -> AsyncioAuthenticator:
    if not cfg.server_secret_key_file or not cfg.allowed_client_keys_dir:
        raise ConfigError(
            "broker.curve.enabled=true needs broker.curve.server_secret_key_file and "
            "broker.curve.allowed_client_keys_dir (create them with tidal.broker.curve.create_keys)"
        )
    secret_file = Path(cfg.server_secret_key_file)
    keys_dir = Path(cfg.allowed_client_keys_dir)
    if not secret_file.is_file():
        raise ConfigError(f"broker.curve.server_secret_key_file={str(secret_file)!r}: no such file")
    if not keys_dir.is_dir():
        raise ConfigError(f"broker.curve.allowed_client_keys_dir={str(keys_dir)!r}: no such directory")
    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise ConfigError(
            f"broker.curve.server_secret_key_file={str(secret_file)!r} holds no secret key "
            "(pass the .key_secret file)"
        )
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys_dir))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return auth
