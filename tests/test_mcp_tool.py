"""MCP adapter round trip against a real stdio MCP server started by the test (tests/mcp_server_for_tests.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from rollout.tools import ToolConfigError, ToolRegistry

SERVER = Path(__file__).with_name("mcp_server_for_tests.py")
SERVER_CONFIG = {"command": sys.executable, "args": [str(SERVER)]}


def mcp_entry(tmp_path: Path, servers: dict | None = None, selected: list[str] | None = None, **config) -> dict:
    """A verl `mcp:` tool entry whose servers file (`{"mcpServers": ...}`) is written under tmp_path."""
    path = tmp_path / f"mcp_servers_{len(list(tmp_path.glob('mcp_servers_*')))}.json"
    path.write_text(json.dumps({"mcpServers": servers or {"test": SERVER_CONFIG}}))
    mcp = {"mcp_servers_config_path": str(path), **({"tool_selected_list": selected} if selected else {})}
    return {"class_name": "rollout.tools.mcp_tool.MCPTool", "config": {"type": "mcp", "timeout_s": 20, **config},
            "mcp": mcp}


def server_processes() -> list[int]:
    """Running copies of the test server started by this process."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if SERVER.name.encode() in cmdline and ppid == os.getpid():
            found.append(int(entry.name))
    return found


@pytest.mark.integration
def test_server_tools_become_polyturn_tools_and_round_trip(tmp_path):
    """MCP (verl's `mcp:` entry): one YAML entry exposes every server tool with the server's schema; calls round-trip (also
    concurrently); server-side errors come back as text with `is_error`; bad arguments are stopped by the
    schema before the server; a hung call is cancelled at the timeout; closing the registry ends the server."""
    registry = ToolRegistry.from_config({"tools": [mcp_entry(tmp_path)]})
    assert registry.names == ["add", "shout", "fail", "slow"]
    add_schema = registry.schemas(["add"])[0]["function"]
    assert add_schema["description"] == "Add two integers."
    assert add_schema["parameters"]["required"] == ["a", "b"]
    assert add_schema["parameters"]["properties"]["a"]["type"] == "integer"
    registry.runner("slow").limits.timeout_s = 1.0

    async def go():
        add, shout, fail, slow = (registry.runner(n) for n in registry.names)
        async with add.session() as iid:
            five = await add.execute(iid, {"a": 2, "b": 3})
            many = await asyncio.gather(*(add.execute(iid, {"a": k, "b": k}) for k in range(8)))
            bad_args = await add.execute(iid, {"a": "two", "b": 3})
        async with shout.session() as iid:
            loud = await shout.execute(iid, {"text": "hello mcp"})
        async with fail.session() as iid:
            failed = await fail.execute(iid, {"message": "the index is down"})
        async with slow.session() as iid:
            hung = await slow.execute(iid, {"seconds": 30})
            quick = await slow.execute(iid, {"seconds": 0})
        running = server_processes()
        await registry.aclose()
        await asyncio.sleep(0.2)
        return five, many, bad_args, loud, failed, hung, quick, running

    five, many, bad_args, loud, failed, hung, quick, running = asyncio.run(asyncio.wait_for(go(), 120))
    assert five.text == "5" and five.error is None and five.metrics == {"is_error": False}
    assert [r.text for r in many] == [str(2 * k) for k in range(8)]
    assert bad_args.error.startswith("invalid_arguments") and "a: 'two' is not of type 'integer'" in bad_args.text
    assert loud.text == "HELLO MCP"
    assert failed.metrics == {"is_error": True} and "the index is down" in failed.text
    assert hung.timed_out and quick.text == "done"
    assert len(running) == 1, "calls share one server connection"
    assert server_processes() == []
    assert {name: c for name, c in registry.counts().items()} == {
        "add": (1, 1),
        "shout": (1, 1),
        "fail": (1, 1),
        "slow": (1, 1),
    }


@pytest.mark.integration
def test_tool_selected_list_picks_a_subset(tmp_path):
    """MCP: `mcp.tool_selected_list` picks a subset; calls go to the server tool of that name."""
    registry = ToolRegistry.from_config({"tools": [mcp_entry(tmp_path, selected=["shout"])]})
    assert registry.names == ["shout"]

    async def go():
        runner = registry.runner("shout")
        async with runner.session() as iid:
            out = await runner.execute(iid, {"text": "quiet"})
        await registry.aclose()
        return out

    assert asyncio.run(asyncio.wait_for(go(), 60)).text == "QUIET"


@pytest.mark.integration
def test_bad_mcp_entries_are_refused_at_load(tmp_path):
    """MCP: a tool the servers do not offer, a server that cannot start, a url server, or no servers file
    fails at load naming the entry."""
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp\.tool_selected_list: \['search'\] not offered"):
        ToolRegistry.from_config({"tools": [mcp_entry(tmp_path, selected=["search"])]})
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp: could not list the tools of MCP server /nonexistent/python"):
        ToolRegistry.from_config({"tools": [mcp_entry(tmp_path, {"x": {"command": "/nonexistent/python"}})]})
    with pytest.raises(ToolConfigError, match=r"MCP server 'web' needs a `command`.*only stdio"):
        ToolRegistry.from_config({"tools": [mcp_entry(tmp_path, {"web": {"url": "http://localhost:1/sse"}})]})
    entry = mcp_entry(tmp_path)
    entry["mcp"] = {}
    with pytest.raises(ToolConfigError, match=r"tools\[0\]\.mcp: needs mcp_servers_config_path"):
        ToolRegistry.from_config({"tools": [entry]})
