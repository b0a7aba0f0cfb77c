"""One sandbox's life through the OpenSandbox Python SDK, unmodified, against pvisor-sandboxd.

Usage: flow.py HOST:PORT (the API key in OPEN_SANDBOX_API_KEY). Prints one JSON line with
what it saw; any failed check raises.
"""

import asyncio
import json
import sys
from datetime import timedelta

from opensandbox import Sandbox
from opensandbox.config import ConnectionConfig


def results(execution):
    """The stdout lines of a command, each a JSON result of one script command."""
    return [json.loads(m.text) for m in execution.logs.stdout]


async def main(domain):
    config = ConnectionConfig(
        domain=domain, protocol="http", request_timeout=timedelta(seconds=60)
    )
    sandbox = await Sandbox.create(
        "pvisor:workload",
        connection_config=config,
        timeout=timedelta(minutes=10),
        metadata={"flow": "sdk"},
        ready_timeout=timedelta(seconds=60),
    )
    seen = {"id": sandbox.id}
    try:
        run = await sandbox.commands.run("fill 64MiB random seed=1; task; digest")
        lines = results(run)
        assert run.exit_code == 0, (run.exit_code, run.error)
        assert run.error is None, run.error
        assert [line["command"] for line in lines][1:] == ["task", "digest"], lines
        digest = lines[2]["digest"]
        assert lines[1]["digest"] == digest, lines
        seen["digest"] = digest

        failed = await sandbox.commands.run("fill 600MiB random")
        assert failed.exit_code == 1, (failed.exit_code, failed.error)
        assert any("application memory" in m.text for m in failed.logs.stderr), failed.logs
        usage = await sandbox.commands.run("no-such-command")
        assert usage.exit_code == 2, (usage.exit_code, usage.error)

        info = await sandbox.get_info()
        assert str(info.status.state).lower().endswith("running"), info.status
        assert info.metadata == {"flow": "sdk"}, info.metadata
        renewed = await sandbox.renew(timedelta(minutes=30))
        seen["renewed"] = str(renewed.expires_at)

        await sandbox.pause()
        info = await sandbox.get_info()
        assert str(info.status.state).lower().endswith("paused"), info.status
        resumed = await Sandbox.resume(sandbox.id, connection_config=config)
        again = await resumed.commands.run("digest")
        assert again.exit_code == 0 and results(again)[0]["digest"] == digest, results(again)
        seen["digest_after_resume"] = results(again)[0]["digest"]
        await resumed.close()
    finally:
        await sandbox.kill()
        await sandbox.close()
    seen["killed"] = True
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
