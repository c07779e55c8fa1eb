"""A small stdio MCP server the MCP adapter tests start as a subprocess (`python tests/mcp_server_for_tests.py`).

Tools: `add(a, b)` (integers), `shout(text)` (upper-cases), `fail(message)` (raises `ToolError`,
so the server reports an error result), `slow(seconds)` (sleeps, for timeout tests).
"""

from __future__ import annotations

import asyncio

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("polyturn-test-server")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()


@server.tool()
def fail(message: str) -> str:
    """Always raise with the given message."""
    raise ToolError(message)


@server.tool()
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await asyncio.sleep(seconds)
    return "done"


if __name__ == "__main__":
    server.run()
