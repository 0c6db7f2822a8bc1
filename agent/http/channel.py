"""The agent's link to its HTTP server process: framed messages over one socketpair (agent/http/process.py).

A frame is a 4-byte big-endian length and its payload. The agent sends pickles (snapshots and what the server
reads from it: its own objects, to its own child); the server sends JSON only, at most MAX_REQUEST_BYTES a frame,
since what it asks carries strings from HTTP clients and the agent must never unpickle what a tenant shaped.
Sends are whole frames under a lock, from any thread; one thread receives.
"""

from __future__ import annotations

import json
import pickle
import socket
import struct
import threading
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 << 20  # the agent's frames: a snapshot of a large node is a few MiB at most
MAX_REQUEST_BYTES = 64 << 10  # the server's frames: a metrics or pod= request, a report of its ports


class ChannelClosed(Exception):
    """The other end went away, or sent what no frame can be."""


class Channel:
    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame = max_frame  # what this end accepts
        self._send_lock = threading.Lock()

    def send_frame(self, payload: bytes) -> None:
        try:
            with self._send_lock:
                self.sock.sendall(HEADER.pack(len(payload)) + payload)
        except OSError as exc:
            raise ChannelClosed(str(exc)) from exc

    def send_object(self, kind: str, value: Any) -> None:
        self.send_frame(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))

    def send_json(self, message: dict[str, Any]) -> None:
        payload = json.dumps(message).encode()
        if len(payload) > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {len(payload)} bytes (at most {MAX_REQUEST_BYTES})")
        self.send_frame(payload)

    def receive_frame(self) -> bytes:
        (length,) = HEADER.unpack(self._exactly(HEADER.size))
        if length > self.max_frame:
            raise ChannelClosed(f"a frame of {length} bytes (at most {self.max_frame})")
        return self._exactly(length)

    def receive_object(self) -> tuple[str, Any]:
        """The agent's next message (the server's end)."""
        kind, value = pickle.loads(self.receive_frame())
        return str(kind), value

    def receive_json(self) -> dict[str, Any]:
        """The server's next request (the agent's end): JSON, an object, or the channel is closed."""
        try:
            message = json.loads(self.receive_frame())
        except ValueError as exc:
            raise ChannelClosed(f"not a JSON request: {exc}") from exc
        if not isinstance(message, dict):
            raise ChannelClosed("a request that is not a JSON object")
        return message

    def _exactly(self, size: int) -> bytes:
        chunks, left = [], size
        while left:
            try:
                chunk = self.sock.recv(min(left, 1 << 20))
            except OSError as exc:
                raise ChannelClosed(str(exc)) from exc
            if not chunk:
                raise ChannelClosed("end of stream")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
