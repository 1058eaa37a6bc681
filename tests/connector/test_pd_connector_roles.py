"""One facade per role, as vLLM's connectors: `PDConnector` builds only its role's half, and a call meant
for the other role is a wiring bug that raises instead of answering as an idle half would."""

from __future__ import annotations

import pytest

from kvferry.connector.base import ConnectorRole
from kvferry.connector.config import PDConfig
from kvferry.connector.facade import PDConnector, WrongRole
from kvferry.connector.scheduler import PDScheduler
from kvferry.connector.worker import PDWorker


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_facade_builds_only_its_own_half(role: str) -> None:
    config = PDConfig(role=role, engine_id=f"{role}-roles")
    scheduler = PDConnector(ConnectorRole.SCHEDULER, config)
    worker = PDConnector(ConnectorRole.WORKER, config)
    try:
        assert isinstance(scheduler.scheduler, PDScheduler)
        assert isinstance(worker.worker, PDWorker)
        with pytest.raises(WrongRole, match="scheduler connector has no worker half"):
            scheduler.get_finished(set())
        with pytest.raises(WrongRole, match="worker connector has no scheduler half"):
            worker.build_connector_meta(type("Out", (), {"finished_req_ids": set()})())
        assert scheduler._worker is None and worker._scheduler is None  # nothing built for the other role
    finally:
        scheduler.close()
        worker.close()
