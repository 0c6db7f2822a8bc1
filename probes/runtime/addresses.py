"""Address parsing shared by config models and probes."""

from __future__ import annotations


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """ "host", "host:port", "[v6]:port" or a bare IPv6 address → (host, port); ValueError when malformed."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: expected [address]:port")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a bare name, IPv4 or IPv6 address
        host, port_text = text, ""
    if not host:
        raise ValueError(f"{text!r}: empty host")
    if port_text == "":
        return host, default_port
    if not port_text.isascii() or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be 1-65535")
    return host, int(port_text)
