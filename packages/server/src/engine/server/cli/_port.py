"""Checking that ``engine serve`` can bind ``--host``/``--port``, before the model loads.

uvicorn binds only once the engine is up, which can take minutes for a large model; a
port that is taken would be reported only then. ``check_can_bind`` tries the same bind
(``SO_REUSEADDR``, as uvicorn sets it) and lets go of the port at once.
"""

from __future__ import annotations

import errno
import socket


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_can_bind(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it.

    Raises:
        ValueError: the port is in use, needs privileges, is out of range, or the host
            is not an address of this machine; the message names ``host:port`` and the fix.
    """
    where = _address(host, port)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port; use one in 1..65535 (e.g. 8000)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"cannot serve on {where}: --host {host!r} does not resolve "
                         f"({exc.strerror}); use an address of this machine, such as "
                         f"127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ValueError(f"cannot serve on {where}: the port is already in use "
                                 f"(another server is listening there); stop it, or choose "
                                 f"a free port with --port N") from None
            if exc.errno == errno.EACCES:
                raise ValueError(f"cannot serve on {where}: ports below 1024 need "
                                 f"privileges; choose --port 1024 or above (e.g. 8000)"
                                 ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"cannot serve on {where}: {host} is not an address of "
                                 f"this machine; use one of its addresses, 127.0.0.1 or "
                                 f"0.0.0.0") from None
            raise ValueError(f"cannot serve on {where}: {exc.strerror}") from None
