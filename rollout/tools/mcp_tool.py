"""MCP tools: the tools of stdio MCP servers become rollout tools (official `mcp` SDK, 2.x),
configured the way verl configures them:

    tools:
      - class_name: rollout.tools.mcp_tool.MCPTool     # or a subclass (e.g. other result parsing)
        config: {type: mcp, timeout_s: 30}             # given to every tool of the servers
        mcp:
          mcp_servers_config_path: mcp_servers.json    # {"mcpServers": {name: {command, args, env, cwd}}}
          tool_selected_list: [search, fetch]          # optional: only these (default: all listed)

Each server tool becomes one `cls(config=..., tool_schema=...)` with the server's own name,
description and input schema; the loader hands it its server's connection as
`tool.mcp_connection` (verl reaches servers through a global client manager instead).
A relative `mcp_servers_config_path` is looked up from the working directory, then next to
the tool YAML. Only stdio servers (`command`) are supported; a `url` server is refused at load.

The servers are listed once at load (in a helper thread with its own event loop, so loading
works inside or outside a running loop). Calls share one persistent connection per server and
event loop, opened on first use and owned by a background task (the SDK's context managers must
be entered and left in the same task); `close()` (the registry's `aclose`) ends it and the
server process. A call cancelled by the runner's timeout is abandoned on the client side.
A server-side error (`is_error`) is returned to the model as text with metric `is_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from rollout.plugins import PluginConfigError, build
from rollout.tools.base import BaseTool
from rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)


def server_parameters(name: str, server: Any, where: str) -> StdioServerParameters:
    """One `mcpServers` entry -> the SDK's stdio parameters; PluginConfigError naming what is missing."""
    if not isinstance(server, dict) or not server.get("command"):
        raise PluginConfigError(
            f"{where}: MCP server {name!r} needs a `command` (and optionally args, env, cwd); only stdio "
            f"servers are supported, got {server!r}"
        )
    return StdioServerParameters(
        command=str(server["command"]),
        args=[str(a) for a in server.get("args", [])],
        env={str(k): str(v) for k, v in (server.get("env") or {}).items()} or None,
        cwd=server.get("cwd"),
    )


def tools_from_mcp_servers(cls: type, config: dict[str, Any], mcp: Any, base_dir: Path | None, where: str) -> list[Any]:
    """The tools of an `mcp:` entry: one `cls(config=, tool_schema=)` per selected server tool."""
    if not isinstance(mcp, dict) or not mcp.get("mcp_servers_config_path"):
        raise PluginConfigError(f"{where}.mcp: needs mcp_servers_config_path (and optionally tool_selected_list)")
    path = Path(mcp["mcp_servers_config_path"])
    if not path.is_absolute() and not path.is_file() and base_dir is not None:
        path = base_dir / path
    try:
        servers = json.loads(path.read_text())["mcpServers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PluginConfigError(
            f"{where}.mcp.mcp_servers_config_path: cannot read an 'mcpServers' mapping from {path} ({exc})"
        ) from exc
    selected = mcp.get("tool_selected_list")
    tools: list[Any] = []
    for server_name, server in servers.items():
        connection = MCPConnection(server_parameters(server_name, server, f"{where}.mcp"))
        try:
            listed = connection.list_tools_blocking()
        except RuntimeError as exc:
            raise PluginConfigError(f"{where}.mcp: {exc}") from exc
        for remote in listed:
            if selected and remote.name not in selected:
                continue
            schema = OpenAIFunctionToolSchema.from_dict(
                {"type": "function", "function": {"name": remote.name, "description": remote.description or "",
                                                   "parameters": remote.input_schema}},
                where=f"{where}: MCP tool {remote.name!r}",
            )
            tool = build(cls, where, config=dict(config), tool_schema=schema)
            tool.mcp_connection = connection
            tools.append(tool)
    missing = sorted(set(selected or ()) - {t.name for t in tools})
    if missing:
        raise PluginConfigError(f"{where}.mcp.tool_selected_list: {missing} not offered by the MCP servers")
    return tools


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
    """One tool of an MCP server; built by `tools_from_mcp_servers` (an `mcp:` tool entry)."""

    mcp_connection: MCPConnection  # set by the loader

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        client = await self.mcp_connection.client()
        result = await client.call_tool(self.name, parameters)
        texts = []
        for block in result.content:
            texts.append(block.text if getattr(block, "type", None) == "text" else f"[{block.type} content]")
        text = "\n".join(texts)
        if not texts and result.structured_content is not None:
            text = str(result.structured_content)
        return ToolResponse(text=text), 0.0, {"is_error": bool(result.is_error)}

    async def close(self) -> None:
        await self.mcp_connection.close()
