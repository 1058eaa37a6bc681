"""`kvferry bench model --quick` measures the numpy engine on SmolLM2 (and transformers when installed)."""

from kvferry.bench import model as model_bench


def test_model_bench_quick_rows() -> None:
    rows = model_bench.run(None, quick=True)
    assert [r["what"].split()[0] for r in rows] == ["prefill", "decode", "decode"]
    assert "batch 8" in rows[2]["what"]
    assert all(r["numpy tok/s"] > 0 and r["threads"] == 1 for r in rows)
    for r in rows:
        assert (r["transformers tok/s"] is None) == (r["ratio"] is None)
