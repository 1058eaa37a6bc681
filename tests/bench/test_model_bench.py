"""`kvferry bench model --quick` measures the numpy engine on SmolLM2 (and transformers when installed)."""

from kvferry.bench import model as model_bench
from kvferry.engine.model_math import RowWeight


def test_model_bench_quick_rows() -> None:
    apply = RowWeight.apply
    rows = model_bench.run(None, quick=True)
    assert RowWeight.apply is apply  # the plain-matmul row put the engine's arithmetic back
    assert [r["what"].split()[0] for r in rows] == ["prefill", "decode", "decode", "decode"]
    assert "batch 8" in rows[2]["what"]
    # What invariance costs: the same batch through one plain matmul, and whether its bits still match.
    assert "plain x @ W.T" in rows[3]["what"] and "bits" in rows[3]["what"]
    assert rows[3]["transformers tok/s"] is None
    assert all(r["numpy tok/s"] > 0 and r["threads"] == 1 for r in rows)
    for r in rows:
        assert (r["transformers tok/s"] is None) == (r["ratio"] is None)
