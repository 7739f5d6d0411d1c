"""Credentials: the job secret, the CURVE keys derived from it, the two roles, and store signatures.

One secret per job, shared by every rank out of band (a file or an environment variable torchrun's ranks
inherit, never the unauthenticated c10d store), and everything else is derived from it::

    JobSecret ──HMAC-SHA256("rollout-sdk/v1/curve/server")────▶ server key pair     (every server)
              ──HMAC-SHA256("rollout-sdk/v1/curve/control")───▶ control key pair    (trainer / driver)
              ──HMAC-SHA256("rollout-sdk/v1/curve/generate")──▶ generate key pair   (workers, gateways)
              ──HMAC-SHA256("rollout-sdk/v1/store")───────────▶ store MAC key       (signs store values)

A 32-byte HMAC output is a Curve25519 secret key (libsodium clamps it); its public half comes from
``zmq.curve_public``.  Roles (enforced by the server on every message, from the ZAP User-Id)::

    generate ... Generate, Abort (its own requests only), Ping, GetInfo, SessionHints (advisory)
    control .... all of the above, plus every control message (weights, pause/resume, release/resume
                 memory, weight versions, flush, weight groups)

A holder of the job secret can act as either role; a :class:`Credentials` file holds one role's key pair
and the servers' public key, so a rollout worker can be given generate rights without the secret.
See docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq
from zmq.utils import z85

from .errors import ConfigError

__all__ = [
    "ENV_CREDENTIALS",
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "ROLES",
    "Credentials",
    "JobSecret",
    "KeyPair",
    "Role",
    "ServerAuth",
    "check_private_file",
    "is_loopback",
    "write_private_file",
]

Role = Literal["generate", "control"]
ROLES: tuple[Role, ...] = ("generate", "control")

#: path of a file holding the job secret (mode 0600)
ENV_SECRET_FILE = "ROLLOUT_SDK_SECRET_FILE"
#: the job secret itself (prefer the file: environment variables show up in /proc/<pid>/environ)
ENV_SECRET = "ROLLOUT_SDK_SECRET"
#: path of a credentials file (one role's keys; ``rollout-sdk credentials``), for clients without the secret
ENV_CREDENTIALS = "ROLLOUT_SDK_CREDENTIALS"

_MIN_SECRET_BYTES = 16
_LABEL = b"rollout-sdk/v1/"
HOW_TO_ENABLE = (
    "create a secret with `rollout-sdk secret --out job.secret` and set "
    f"{ENV_SECRET_FILE}=job.secret on every node (docs/security.md)"
)


def is_loopback(host: str) -> bool:
    """True for binds only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_private_file(path: Path) -> None:
    """Refuse a key file that other users can read (anything but mode 0600 / 0400, or not a file)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError("secret file", str(path), f"cannot read it: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError("secret file", str(path), "is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            "secret file", str(path), f"is readable by others (mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 it"
        )


def write_private_file(path: Path, data: bytes) -> None:
    """Create ``path`` with mode 0600 (never widening an existing file's mode); fails if it exists."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_seed(cls, seed: bytes) -> KeyPair:
        secret = z85.encode(seed)
        return cls(public=zmq.curve_public(secret), secret=secret)


@dataclass(frozen=True)
class Credentials:
    """What a client presents: one role's key pair and the public key it expects of every server.

    Example (a rollout worker that may generate, nothing more)::

        creds = JobSecret.from_env().credentials("generate")   # on the trainer's side
        creds.save("worker.key")                               # mode 0600; hand it over out of band
        RolloutClient(servers=[...], credentials=Credentials.load("worker.key"))
    """

    role: Role
    keys: KeyPair
    server_public: bytes

    def save(self, path: str | os.PathLike[str]) -> None:
        body = {
            "role": self.role,
            "public": self.keys.public.decode(),
            "secret": self.keys.secret.decode(),
            "server_public": self.server_public.decode(),
        }
        write_private_file(Path(path), json.dumps(body).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Credentials:
        p = Path(path)
        check_private_file(p)
        try:
            body = json.loads(p.read_text())
            role = body["role"]
            keys = KeyPair(public=body["public"].encode(), secret=body["secret"].encode())
            server_public = body["server_public"].encode()
            consistent = zmq.curve_public(keys.secret) == keys.public and len(server_public) == 40
        except (ValueError, KeyError, TypeError, AttributeError, zmq.ZMQError) as exc:
            raise ConfigError("credentials", str(p), f"not a rollout-sdk credentials file: {exc}") from exc
        if role not in ROLES or not consistent:
            raise ConfigError("credentials", str(p), "not a rollout-sdk credentials file (bad role or keys)")
        return cls(role=role, keys=keys, server_public=server_public)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials | None:
        """``ROLLOUT_SDK_CREDENTIALS`` (a file), else control credentials from the job secret, else None."""
        env = os.environ if env is None else env
        path = env.get(ENV_CREDENTIALS)
        if path:
            return cls.load(path)
        secret = JobSecret.from_env(env)
        return secret.credentials("control") if secret is not None else None


@dataclass(frozen=True)
class ServerAuth:
    """What a server needs: its key pair and which client public key carries which role."""

    keys: KeyPair
    clients: Mapping[bytes, Role]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ServerAuth | None:
        secret = JobSecret.from_env(env)
        return secret.server_auth() if secret is not None else None


class JobSecret:
    """The one secret a job shares.  Its repr never shows it.

    Loaded from ``ROLLOUT_SDK_SECRET_FILE`` (a file of mode 0600) or ``ROLLOUT_SDK_SECRET``;
    :meth:`generate` makes a fresh one (the embedded default does, per process).
    """

    def __init__(self, value: bytes) -> None:
        if len(value) < _MIN_SECRET_BYTES:
            raise ConfigError("secret", f"<{len(value)} bytes>", f"must be at least {_MIN_SECRET_BYTES} bytes")
        self._value = value

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_hex(32).encode())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> JobSecret:
        p = Path(path)
        check_private_file(p)
        return cls(p.read_bytes().strip())

    def write(self, path: str | os.PathLike[str]) -> None:
        write_private_file(Path(path), self._value + b"\n")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobSecret | None:
        env = os.environ if env is None else env
        path = env.get(ENV_SECRET_FILE)
        if path:
            return cls.read(path)
        value = env.get(ENV_SECRET)
        return cls(value.encode()) if value else None

    def _derive(self, label: str) -> bytes:
        return hmac.new(self._value, _LABEL + label.encode(), hashlib.sha256).digest()

    def keypair(self, name: str) -> KeyPair:
        return KeyPair.from_seed(self._derive(f"curve/{name}"))

    def credentials(self, role: Role) -> Credentials:
        if role not in ROLES:
            raise ConfigError("role", role, f"must be one of {ROLES}")
        return Credentials(role=role, keys=self.keypair(role), server_public=self.keypair("server").public)

    def server_auth(self) -> ServerAuth:
        return ServerAuth(keys=self.keypair("server"), clients={self.keypair(r).public: r for r in ROLES})

    @property
    def store_key(self) -> bytes:
        """The key that signs (HMAC) what the job writes to, and acts on from, the c10d store."""
        return self._derive("store")
