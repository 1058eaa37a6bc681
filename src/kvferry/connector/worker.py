"""The P/D connector's worker half: on P the producer and the bootstrap server, on D the consumer, each
rank's transfer engine; it carries out the scheduler half's `PDMetadata` once per step and reports back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvferry.connector.base import ConnectorMetadata
from kvferry.connector.bootstrap import BootstrapClient, BootstrapServer, Registration
from kvferry.connector.config import PDConfig
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig
from kvferry.connector.layout import KVCacheSpec, KVLayout, PagedKVLayout
from kvferry.connector.loads import LoadReport
from kvferry.connector.metadata import PDMetadata
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.addr import join_addr
from kvferry.transfer.base import TransferEngine
from kvferry.transfer.engines import new_engine


class PDWorker:
    """The worker half (the engine's worker thread)."""

    def __init__(self, config: PDConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.bootstrap_server: BootstrapServer | None = None
        self.transfer_engines: list[TransferEngine] = []
        self._loads: list[LoadReport] = []  # of the last `get_finished`'s finished_recving
        self._quarantine = False  # the host quarantines blocks (`quarantine_loads`)
        self._waker: Callable[[], None] | None = None

    @property
    def is_decode(self) -> bool:
        return self.config.role == "decode"

    def register_kv_cache(self, spec: KVCacheSpec, kv_cache: np.ndarray) -> None:
        self.register_kv_layout(PagedKVLayout(spec, kv_cache))

    def register_kv_layout(self, layout: KVLayout) -> None:
        """Any memory layout (vLLM's per-layer tensors, say) that can name a block's byte runs."""
        ranks = range(self.config.tp_size) if self.config.tp_rank is None else [self.config.tp_rank]
        engines = {rank: self._new_transfer_engine(rank) for rank in ranks}
        self.transfer_engines = list(engines.values())
        if self.is_decode:
            c = self.config
            consumer_config = ConsumerConfig(
                tp_size=c.tp_size, recv_timeout_s=c.recv_timeout_s, kv_load_deadline_s=c.kv_load_deadline_s,
                checksums=c.checksums, faults=c.faults, heartbeat_interval_s=c.heartbeat_interval_s,
                heartbeat_timeout_s=c.heartbeat_timeout_s, heartbeat_ceiling_s=c.heartbeat_ceiling_s,
                secret=c.secret, prefill_allow=c.prefill_allow, bootstrap_timeout_s=c.bootstrap_timeout_s)
            bootstrap = BootstrapClient(consumer_config.bootstrap_timeout_s, self.config.secret)
            self.consumer = Consumer(layout, engines, consumer_config, self.metrics, bootstrap)
            self._install_waker()
            return
        self.producer = Producer(layout, engines, self.config.host, self.config.abort_timeout_s,
                                 self.config.faults, self.metrics, self.config.secret,
                                 control_port=self.config.control_port,
                                 advertise_host=self.config.advertised_host, tp_size=self.config.tp_size)
        self._install_waker()
        if self.config.tp_rank is not None:
            return  # one rank of several processes: the engine's owner serves the bootstrap
        self.bootstrap_server = BootstrapServer(self.config.host, self.config.bootstrap_port, self.config.faults,
                                                self.config.secret)
        for reg in self.registrations():
            self.bootstrap_server.register(reg)
        self.bootstrap_server.start()

    def registrations(self) -> list[Registration]:
        """P: the bootstrap entries of the ranks this process serves (their control addresses, boot ids)."""
        if self.producer is None:
            return []
        ranks = sorted(self.producer.engines)
        return [Registration(self.config.engine_id, self.config.tp_size, rank, addr, boot)
                for rank, addr, boot in zip(ranks, self.producer.control_addrs, self.producer.boot_ids, strict=True)]

    def _new_transfer_engine(self, rank: int) -> TransferEngine:
        port = self.config.data_port and self.config.data_port + rank
        return new_engine(self.config.transfer, self.config.host, port, self.config.secret or b"",
                          join_addr(self.config.advertised_host, port))

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, PDMetadata)
        if self.producer is not None:
            self.producer.step_started()
            for transfer_id, request_id in metadata.working:  # before to_send: it may end in its first step
                self.producer.add_working(transfer_id, request_id)
            for p in metadata.progress:
                self.producer.add_progress(p.transfer_id, p.request_id, p.block_ids, p.num_tokens, p.prompt_digest)
            for send in metadata.to_send:
                self.producer.add_ready(send.transfer_id, send.request_id, send.block_ids, send.num_tokens,
                                        send.prompt_digest, send.first_token)
            for dead in metadata.dead_transfers:
                self.producer.add_dead(dead.transfer_id, dead.request_id, dead.lent)
        if self.consumer is not None:
            self.consumer.start_pulls(metadata.to_pull)
            # A request that ended before admission shows up here too, with its release-only pull.
            releasing = {p.request_id for p in metadata.to_pull if not p.block_ids}
            self.consumer.abort(metadata.finished_req_ids - releasing)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.producer is not None:
            self.producer.step_ended()
            return self.producer.drain_finished(), set()
        if self.consumer is not None:
            r = self.consumer.outbox.drain_report()
            self._loads = list(r.loads.values())
            return r.released, r.finished  # D "sends" nothing: what comes back is quarantined blocks
        return set(), set()

    def take_load_reports(self) -> list[LoadReport]:
        loads, self._loads = self._loads, []
        return loads

    def quarantine_loads(self) -> bool:
        self._quarantine = True
        self._install_waker()
        return True

    def set_waker(self, wake: Callable[[], None]) -> bool:
        self._waker = wake
        self._install_waker()
        return True

    def _install_waker(self) -> None:
        """The host's hooks (waker, quarantine) onto whichever halves exist, in either order of calls."""
        if self.consumer is not None:
            self.consumer.outbox.quarantine = self._quarantine
        if self._waker is None:
            return
        if self.consumer is not None:
            self.consumer.outbox.waker = self._waker
        if self.producer is not None:
            self.producer.table.waker = self._waker

    def stats(self) -> dict[str, Any]:
        return {
            "pending_pulls": self.consumer.pending_pulls if self.consumer else 0,
            "pending_sends": self.producer.table.pending_sends() if self.producer else 0,
            "writes_in_flight": self.producer.table.writes_in_flight() if self.producer else 0,
            # D: data-plane reads posted and not ended (NIXL: a frozen P holds them)
            "reads_in_flight": sum(getattr(e, "stats", {}).get("reads_in_flight", 0) for e in self.transfer_engines),
            "transfer_addrs": [e.address for e in self.transfer_engines],  # advertised
            "transfer_bound": [getattr(e, "bound_address", e.address) for e in self.transfer_engines],
            "control_addrs": self.producer.control_addrs if self.producer else [],  # advertised
            "control_boots": self.producer.boot_ids if self.producer else [],  # as the bootstrap answers
            "control_bound": self.producer.control_bound if self.producer else [],
        }

    def close(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        for engine in self.transfer_engines:
            engine.close()
