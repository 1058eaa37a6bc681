"""The info endpoints sglang-router probes on its workers (`/get_model_info`, `/get_server_info` and their
short names): what model an instance serves and which side of P/D it is."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from kvferry.engine.engine import Engine

_DISAGGREGATION_MODE = {"prefill": "prefill", "decode": "decode", "both": "null"}  # sglang's names


def install_info_routes(app: FastAPI, engine: Engine, model_name: str, health_extra: dict[str, Any]) -> None:
    def model_info() -> dict[str, Any]:
        return {"model_path": model_name, "tokenizer_path": None, "is_generation": True}

    def server_info() -> dict[str, Any]:
        bootstrap = health_extra.get("kv_bootstrap_addr")
        return {
            **model_info(),
            "engine_id": engine.config.engine_id,
            "disaggregation_mode": _DISAGGREGATION_MODE[engine.config.role],
            "disaggregation_bootstrap_port": int(bootstrap.rsplit(":", 1)[1]) if bootstrap else None,
            "page_size": engine.config.block_size,
        }

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])
