"""MCP adapter: the tools of a stdio MCP server become polyturn tools (official `mcp` SDK, 2.x).

One YAML entry names a server; by default it expands to one polyturn tool per server tool,
with the server's own names, descriptions and input schemas:

    tools:
      - class_name: rollout.tools.mcp_tool.MCPTool
        config:
          server: {command: python, args: [my_server.py], env: {KEY: value}, cwd: /some/dir}
          tools: [search, fetch]        # optional: only these (default: all the server lists)
          timeout_s: 30                 # runner limits apply per tool, as for any tool

With a `tool_schema` in the entry, it becomes exactly one tool: the server tool of that name,
presented to the model with the given schema (verl's one-entry-per-tool style).

The server is listed once at load (in a helper thread with its own event loop, so loading
works inside or outside a running loop). Calls share one persistent connection per event
loop, opened on first use and owned by a background task (the SDK's context managers must
be entered and left in the same task); `close()` (the registry's `aclose`) ends it and the
server process. A call cancelled by the runner's timeout is abandoned on the client side.
A server-side error (`is_error`) is returned to the model as text with metric `is_error`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from rollout.tools.base import BaseTool
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)


def server_parameters(config: dict[str, Any]) -> StdioServerParameters:
    """`config.server` -> the SDK's stdio parameters; ValueError naming the missing key."""
    server = config.get("server")
    if not isinstance(server, dict) or not server.get("command"):
        raise ValueError("MCPTool needs config.server.command (and optionally args, env, cwd) of a stdio MCP server")
    return StdioServerParameters(
        command=str(server["command"]),
        args=[str(a) for a in server.get("args", [])],
        env={str(k): str(v) for k, v in (server.get("env") or {}).items()} or None,
        cwd=server.get("cwd"),
    )


class MCPConnection:
    """One persistent client connection to a stdio MCP server, re-opened per event loop."""

    def __init__(self, params: StdioServerParameters):
        self.params = params
        self._client: Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._owner: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None

    def list_tools_blocking(self) -> list[Any]:
        """The server's tools, fetched with a short-lived connection in a helper thread."""
        box: dict[str, Any] = {}

        async def fetch() -> None:
            async with Client(self.params) as client:
                box["tools"] = (await client.list_tools()).tools

        def run() -> None:
            try:
                asyncio.run(fetch())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="mcp-list-tools")
        thread.start()
        thread.join()
        if "error" in box:
            raise RuntimeError(
                f"could not list the tools of MCP server {self.params.command} {' '.join(self.params.args)}: "
                f"{type(box['error']).__name__}: {box['error']}; check config.server"
            ) from box["error"]
        return box["tools"]

    async def _serve(self, ready: asyncio.Future) -> None:
        try:
            async with Client(self.params) as client:
                self._client = client
                ready.set_result(None)
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to whoever waits for the connection
            if ready.done():
                logger.warning("MCP connection to %s ended: %s: %s", self.params.command, type(exc).__name__, exc)
            else:
                ready.set_exception(exc)
        finally:
            self._client = None
            if not ready.done():
                ready.cancel()

    async def client(self) -> Client:
        """The connection of the running loop, opened on first use."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._owner is None or self._owner.done():
            self._loop, self._stop = loop, asyncio.Event()
            ready = loop.create_future()
            self._owner = loop.create_task(self._serve(ready), name="mcp-connection")
            await ready
        while self._client is None:  # another task is opening it
            if self._owner.done():
                raise RuntimeError("MCP connection closed")
            await asyncio.sleep(0.01)
        return self._client

    async def close(self) -> None:
        """End the connection of the running loop (and with it the server process)."""
        owner, self._owner = self._owner, None
        if owner is not None and self._loop is asyncio.get_running_loop() and not owner.done():
            self._stop.set()
            await owner


class MCPTool(BaseTool):
    """One tool of an MCP server; build them with `MCPTool.from_config` (the registry does)."""

    def __init__(
        self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema, connection: MCPConnection, remote_name: str
    ):
        super().__init__(config, tool_schema)
        self.connection = connection
        self.remote_name = remote_name

    @classmethod
    def from_config(cls, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None) -> list[BaseTool]:
        connection = MCPConnection(server_parameters(config))
        listed = {t.name: t for t in connection.list_tools_blocking()}
        if tool_schema is not None:
            name = tool_schema.function.name
            if name not in listed:
                raise ValueError(f"tool_schema names {name!r}, but the MCP server offers {sorted(listed)}")
            return [cls(config, tool_schema, connection, name)]
        wanted = config.get("tools") or list(listed)
        missing = [n for n in wanted if n not in listed]
        if missing:
            raise ValueError(f"config.tools lists {missing}, not offered by the MCP server; it offers {sorted(listed)}")
        tools: list[BaseTool] = []
        for name in wanted:
            remote = listed[name]
            schema = OpenAIFunctionToolSchema.from_dict(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": remote.description or "",
                        "parameters": remote.input_schema,
                    },
                },
                where=f"MCP tool {name!r}",
            )
            tools.append(cls(config, schema, connection, name))
        return tools

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        client = await self.connection.client()
        result = await client.call_tool(self.remote_name, parameters)
        texts = []
        for block in result.content:
            texts.append(block.text if getattr(block, "type", None) == "text" else f"[{block.type} content]")
        text = "\n".join(texts)
        if not texts and result.structured_content is not None:
            text = str(result.structured_content)
        return ToolResponse(text=text), 0.0, {"is_error": bool(result.is_error)}

    async def close(self) -> None:
        await self.connection.close()
