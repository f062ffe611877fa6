"""``bench.l3``: the file backend's bandwidth rows, and the quick run: a restart in fresh processes
finds the pages a first process wrote (warm) and none in an empty directory (cold), its section
keeps the suite's contract (integrity counters, no ``seconds``) and its JSON is written."""

from __future__ import annotations

from pathlib import Path

from bench.l3.bench import QUESTION, bandwidth, run


def test_every_path_moves_the_pages() -> None:
    res = bandwidth(pages=4)
    assert res["bytes"] == 4 * res["page_bytes"] == 4 * 2 * 8 * 8 * 16 * 128 * 2
    assert min(v for k, v in res.items() if k.endswith("_gbps")) > 0


def test_a_warm_restart_reads_what_the_first_process_wrote(tmp_path: Path) -> None:
    section = run(quick=True, out_dir=tmp_path)  # 16 prompts of 256 tokens
    assert "seconds" not in section and section["integrity"] == {"integrity_errors": 0}
    runs = section["restart"]
    assert runs["fill"]["storage"]["backup_tokens"] == 16 * 256
    assert runs["warm"]["l3_hit_tokens"] == 16 * 256  # every full page of the first prompt
    assert runs["warm"]["prompt_tokens"] == 16 * (256 + QUESTION)
    assert runs["cold"]["l3_hit_tokens"] == 0
    assert all(r["integrity_errors"] == 0 for r in runs.values())
    assert (tmp_path / "bench_l3.json").exists() and section["bandwidth"]["pages"] == 64
