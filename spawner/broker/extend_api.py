"""Extending a session's time limit through the API (``openapi.yaml``).

- ``POST allocations/{id}/extend {"hours": 2}``: the allocation's owner asks for more time;
  the ledger decides by the policy (``spawner.policy.extensions``) and records it. An admin
  of the hub may extend anyone's, past the policy. On Slurm the hub then raises the job's
  TimeLimit (``scontrol update``, which only Slurm's operators may do for a raise); if Slurm
  refuses, the extension is taken back and the answer says why. Another user's allocation is
  404, as everywhere.
- ``GET extensions[?user=NAME]``: every extension, newest first (a user: their own).
"""

from __future__ import annotations

import logging

from spawner.broker import access
from spawner.broker import requests as schemas
from spawner.broker import responses as views
from spawner.broker.handlers import APIHandler
from spawner.policy.limits import Refusal

log = logging.getLogger("gpuhub.broker")


class ExtendHandler(APIHandler):
    async def post(self, allocation_id: str):
        caller, a = await self.find_allocation(allocation_id)
        try:
            body = schemas.parse_json_object(self.request.body, self.broker.settings.max_body_bytes)
            hours = schemas.parse_extend(body)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        admin = access.is_admin(caller) and caller.name != a.user  # an admin's own obeys the policy
        ledger = self.broker.ledger
        try:
            extended, ext = await self.broker.run(ledger.extend, a.id, hours, caller.name, admin=admin)
        except Refusal as r:
            return self.fail(r.status_code, r.message, r.reason)
        if extended.backend == "slurm" and extended.backend_job_id:
            problem = await self._slurm_time(extended.backend_job_id, extended.time_limit_seconds)
            if problem:
                await self.broker.run(ledger.undo_extension, ext.id)
                return self.fail(
                    502,
                    f"Not extended: Slurm refused the new time limit of job {extended.backend_job_id}: "
                    f"{problem}. The session still ends at its old time; ask an admin of this hub.",
                    "slurm_refused",
                )
        log.info(
            "extended %s's allocation %s by %s s (by %s): now %s s",
            a.user,
            a.id,
            ext.seconds,
            caller.name,
            extended.time_limit_seconds,
        )
        self.finish({**self.allocation_json(extended), "extension": views.extension_json(ext)})

    async def _slurm_time(self, job_id: str, seconds: float) -> str | None:
        """Raise the job's TimeLimit to ``seconds``; Slurm's refusal, or None."""
        from spawner.slurm import SlurmError
        from spawner.slurm.commands import time_limit_argv
        from spawner.slurm.watcher import run_command

        try:
            await run_command(time_limit_argv(job_id, seconds), 20)
        except SlurmError as e:
            return str(e)
        return None


class ExtensionsHandler(APIHandler):
    async def get(self):
        who = self.whose("extensions")
        found = await self.broker.run(self.broker.ledger.extensions, who)
        self.finish({"extensions": [views.extension_json(e) for e in found]})
