"""The master port dstrain picks for a one-node job (dstrain/launcher/topology.py): free to listen on
every address, and outside the kernel's range for outgoing connections, which could take it in the
seconds before the ranks' rendezvous binds it."""

from __future__ import annotations

import socket

from dstrain.launcher.topology import _ephemeral_range, free_port


def test_free_port_is_listenable_and_outside_the_outgoing_connection_range():
    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # random, so two jobs started together rarely pick the same one
    for port in ports:
        assert 20000 <= port < low or low <= 20000, (port, low, high)
        with socket.socket() as sock:
            sock.bind(("", port))
            sock.listen()


def test_a_port_in_use_is_never_picked(monkeypatch):
    import dstrain.launcher.topology as topology

    monkeypatch.setattr(topology, "_ephemeral_range", lambda: (20010, 60999))  # candidates: 20000-20009
    held = []
    try:
        for port in range(20000, 20010):
            sock = socket.socket()
            try:
                sock.bind(("", port))
                held.append(sock)
            except OSError:  # already taken by something else: just as good
                sock.close()
        spare = held.pop()  # one candidate left free
        free = spare.getsockname()[1]
        spare.close()
        picks = {free_port() for _ in range(5)}
        assert picks <= {free} | set(range(topology._ephemeral_range()[0], 65536)), picks
        assert not picks & {s.getsockname()[1] for s in held}
    finally:
        for sock in held:
            sock.close()
