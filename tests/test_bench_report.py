"""`make bench`'s harness (bench/run.py): reading the scripts' output and building the table, without servers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


SAMPLE = {
    "drain": {"figures": {"executions_per_s": 7000.0, "lua_dequeue_items_per_s": 70000.0, "worker_cpu_us": 200.0,
                          "lua_dequeue_client_cpu_us": 4.0, "pg_update_rows_per_s": 35000.0}, "error": ""},
    "lateness": {"figures": {"scan_tick_1k_ms": 2.0, "scan_tick_1m_ms": 3.0, "lateness_p99_ms": 20.0,
                             "burst_all_started_s": 1.5}, "error": ""},
    "trigger": {"figures": {}, "error": "exit 1: Traceback ... boom"},
}  # fmt: skip


def by_figure(rows: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    return {str(row["figure"]): row for row in rows}


def test_rows_judge_targets_against_the_value_or_the_ratio_to_the_floor(harness: ModuleType) -> None:
    rows = by_figure(harness.build_rows(SAMPLE))
    drain = rows["drain: executions/s (50,000 runs, 1 worker)"]
    assert drain["result"] == "pass"
    assert drain["ratio"] == pytest.approx(0.1)
    assert rows["drain: worker CPU per execution"]["result"] == "MISS"  # 200 µs > 150 µs
    assert rows["drain: worker CPU per execution"]["ratio"] == pytest.approx(50)
    assert rows["scan tick, 1,000,000 definitions (100 due)"]["ratio"] == pytest.approx(1.5)
    assert rows["scan tick, 1,000,000 definitions (100 due)"]["result"] == "pass"  # within 2x the 1,000 tick
    assert rows["10,000 jobs due in one second: all started"]["floor"] == pytest.approx(10_000 / 7000)
    assert rows["drain: Valkey CPU per execution"]["result"] == "missing"  # the script did not report it
    assert not any(name.startswith(("failover", "idle")) for name in rows)  # not run: no rows


def test_a_crashed_measurement_shows_its_error_in_each_of_its_rows(harness: ModuleType) -> None:
    rows = harness.build_rows(SAMPLE)
    trigger = [row for row in rows if str(row["figure"]).startswith("TriggerJob")]
    assert len(trigger) == 3
    assert all(str(row["result"]).startswith("error: exit 1") for row in trigger)
    text = harness.render_text(rows)
    assert "error: exit 1: Traceback ... boom" in text
    assert "7,000 /s" in text
    markdown = harness.render_markdown(rows).splitlines()
    assert markdown[0].startswith("| figure | value | target")
    assert len(markdown) == len(rows) + 2


def test_output_is_read_from_the_last_json_line_or_the_trigger_benchs_text(harness: ModuleType) -> None:
    assert harness.parse_output('queued\n{"a": 1}\n{"b": 2.5}\n') == {"b": 2.5}
    text = ("TriggerJob from 50 concurrent callers for 10.0s over 1 channel(s): 3,210 RPCs/s, p50 14.2 ms, "
            "p99 40.0 ms\ncodes: {'OK': 32100}; server CPU 250 us per call\n")  # fmt: skip
    assert harness.parse_output(text) == {"rpcs_per_s": 3210.0, "p50_ms": 14.2, "p99_ms": 40.0, "server_cpu_us": 250.0}
    with pytest.raises(ValueError, match="no JSON"):
        harness.parse_output("Traceback (most recent call last):\n")


def test_a_saved_report_prints_again(harness: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    machine = {"cpus": 2, "cpu_model": "X", "python": "3.11", "load_average_at_start": [1.0]}
    report = {"rows": harness.build_rows(SAMPLE), "notes": ["drain: 50000 runs"], "machine": machine, "wall_s": 600}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    harness.print_report(json.loads(path.read_text()), markdown=True)
    out = capsys.readouterr().out
    assert "| drain: executions/s (50,000 runs, 1 worker) | 7,000 /s | ≥ 6,500 /s |" in out
    assert "2 CPUs (X)" in out


def test_the_docs_table_is_replaced_between_the_marker_and_the_machine_line(
    harness: ModuleType, tmp_path: Path
) -> None:
    page = tmp_path / "performance.md"
    page.write_text(f"## Performance\n\n{harness.DOCS_MARKER}old table\n\nold machine\n\nWhat each row runs\n")
    report = {"rows": harness.build_rows(SAMPLE), "wall_s": 600, "started": "2026-12-01T04:00:00+00:00",
              "machine": {"cpus": 2, "cpu_model": "X", "python": "3.11", "load_average_at_start": [1.0]}}  # fmt: skip
    harness.update_docs(report, page)
    harness.update_docs(report, page)  # again: the same text, nothing doubled
    text = page.read_text()
    assert "old" not in text
    assert text.count("| figure | value |") == 1
    assert "2 CPUs (X), Python 3.11, load average 1.00 at the start; `make bench` took 10.0 min (2026-12-01)." in text
    assert text.endswith("\n\nWhat each row runs\n")


def test_a_failed_phase_shows_in_the_rows_it_left_empty_only(harness: ModuleType) -> None:
    results = {"lateness": {"figures": {"scan_tick_1k_ms": 2.0, "errors": ["burst: RuntimeError: stuck"]}, "error": ""}}
    rows = by_figure(harness.build_rows(results))
    assert rows["10,000 jobs due in one second: all started"]["result"] == "error: burst: RuntimeError: stuck"
    assert rows["scan tick, 1,000 definitions (100 due)"]["result"] == ""  # measured, no target


def test_the_performance_page_carries_the_marker(harness: ModuleType) -> None:
    assert harness.DOCS_PAGE.read_text().count(harness.DOCS_MARKER) == 1


def test_limit_rows_judge_the_rate_window_drain_rate_and_the_overhead_ratio(harness: ModuleType) -> None:
    results = {
        "limits-rate": {"figures": {"rate_max_starts_1s": 111, "rate_drain_per_s": 101.0, "free_max_starts_1s": 4000,
                                    "free_executions_per_s": 5000.0}, "error": ""},
        "limits-overhead": {"figures": {"capped_executions_per_s": 4000.0, "free_executions_per_s": 5000.0,
                                        "capped_cpu_us": 330.0, "free_cpu_us": 300.0}, "error": ""},
        "limits-noisy": {"figures": {"quiet_p99_noisy_ms": 30.0, "quiet_p99_alone_ms": 20.0,
                                     "quiet_p99_rise_ms": 10.0}, "error": ""},
    }  # fmt: skip
    rows = by_figure(harness.build_rows(results))
    assert rows["rate limit 100/s burst 10: most starts in a 1 s window (5,000 runs)"]["result"] == "MISS"  # 111
    assert rows["rate limit 100/s burst 10: drain rate (≥ 95)"]["result"] == "pass"
    assert rows["rate limit 100/s burst 10: drain rate (≤ 105)"]["result"] == "pass"
    overhead = rows["drain with one limit: executions/s (median)"]
    assert overhead["ratio"] == pytest.approx(0.8)
    assert overhead["result"] == "MISS"  # 20 % slower: more than 15 %
    assert overhead["target"] == "≥ 0.85× floor"  # noqa: RUF001
    cost = rows["drain with one limit: CPU per execution (median)"]
    assert cost["ratio"] == pytest.approx(1.1)
    assert cost["target"] == ""  # informative: the throughput row above is the issue's
    assert rows["quiet cron p99 rise from the noisy key"]["result"] == "pass"


def test_limits_bench_windows_and_drain_rate() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("limits_bench", ROOT / "bench" / "limits_bench.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    # A GCRA at 100/s with burst 10: 11 at once, then one every 10 ms.
    starts = [0.0] * 11 + [0.01 * i for i in range(1, 490)]
    assert module.max_in_window(starts) == 110  # [0, 1): 11 + 99
    assert module.drain_rate(starts, 10) == pytest.approx(100)
    assert module.max_in_window([0.0, 0.5, 1.0, 1.5]) == 2  # half-open: 1.0 is not in [0, 1)
    assert module.max_in_window([]) == 0
    assert module.drain_rate([1.0, 2.0], 10) is None


def test_bulk_trigger_rows_judge_runs_per_second_beside_the_raw_insert_floor(harness: ModuleType) -> None:
    figures = {"runs_per_s": 21000.0, "raw_insert_rows_per_s": 30000.0, "server_cpu_us_per_run": 40.0,
               "postgres_cpu_us_per_run": 30.0, "runs_recorded": 210000, "calls": 210, "errors": 0}  # fmt: skip
    rows = by_figure(harness.build_rows({"bulk-trigger": {"figures": figures, "error": ""}}))
    runs = rows["BatchTriggerJobs: runs recorded/s (10 callers, 1,000 items per call)"]
    assert runs["result"] == "pass"
    assert runs["ratio"] == pytest.approx(0.7)
    assert runs["target"] == "≥ 20,000 /s"
    assert rows["BatchTriggerJobs: server CPU per run"]["value"] == 40.0
    slow = by_figure(harness.build_rows({"bulk-trigger": {"figures": {**figures, "runs_per_s": 5000.0}, "error": ""}}))
    assert slow["BatchTriggerJobs: runs recorded/s (10 callers, 1,000 items per call)"]["result"] == "MISS"
    assert any(
        note.startswith("bulk-trigger: 210000 runs recorded")
        for note in harness.notes({"bulk-trigger": {"figures": figures}})
    )


def test_the_remote_drain_row_is_judged_on_its_ratio_to_the_in_process_drain(harness: ModuleType) -> None:
    figures = {"remote_executions_per_s": 3000.0, "inprocess_executions_per_s": 8000.0, "remote_server_cpu_us": 120.0,
               "remote_sdk_cpu_us": 35.0, "inprocess_worker_cpu_us": 60.0, "runs": 20000,
               "rounds": [{"remote_ratio": 0.375}]}  # fmt: skip
    results = {"remote": {"figures": figures, "error": ""}}
    rows = by_figure(harness.build_rows(results))
    drain = rows["remote worker drain: executions/s (20,000 runs, 1 server + 1 Python SDK worker)"]
    assert drain["ratio"] == pytest.approx(0.375)
    assert drain["result"] == "MISS"  # under 0.5x the in-process drain
    assert drain["target"] == "≥ 0.5× floor"  # noqa: RUF001
    assert rows["remote worker drain: server CPU per execution"]["ratio"] == pytest.approx(2)
    assert rows["remote worker drain: SDK worker CPU per execution"]["floor"] == pytest.approx(60)
    figures["remote_executions_per_s"] = 4400.0
    assert by_figure(harness.build_rows(results))[drain["figure"]]["result"] == "pass"
    assert "remote: 20000 runs per drain, 1 round(s), remote ÷ in-process by round: 0.38" in harness.notes(results)


def test_cluster_rows_judge_cpu_per_execution_against_one_valkey_and_exactly_once(harness: ModuleType) -> None:
    figures = {"one_executions_per_s": 6000.0, "one_cpu_us": 200.0, "cluster1_executions_per_s": 4000.0,
               "cluster1_cpu_us": 320.0, "one3_cpu_us": 250.0, "cluster3_executions_per_s": 4500.0,
               "cluster3_cpu_us": 350.0, "sharded_not_exactly_once": 0, "sharded_runs_verified": 600000,
               "cluster1_duplicates": 0, "cluster3_duplicates": 0, "cluster1_missing": 0, "cluster3_missing": 0,
               "runs": 50000, "rounds": 3, "cluster3_per_shard": [16600, 16700, 16700]}  # fmt: skip
    results = {"cluster": {"figures": figures, "error": ""}}
    rows = by_figure(harness.build_rows(results))
    one_worker = rows["Valkey Cluster, 1 worker: CPU per execution (worker, 6 Valkey, PostgreSQL)"]
    assert one_worker["ratio"] == pytest.approx(1.6)
    assert one_worker["result"] == "MISS"  # over 1.5x one Valkey's CPU per execution
    three = rows["Valkey Cluster, 3 workers: CPU per execution"]
    assert three["floor"] == pytest.approx(250)  # against one Valkey with as many workers
    assert three["result"] == "pass"
    speed = rows["Valkey Cluster (3 masters, 3-shard queue), 1 worker: executions/s"]
    assert speed["floor"] == pytest.approx(6000)
    assert speed["result"] == ""  # no target on speed: one machine
    assert rows["sharded drains: runs not succeeded exactly once"]["result"] == "pass"
    figures["sharded_not_exactly_once"] = 1
    assert by_figure(harness.build_rows(results))["sharded drains: runs not succeeded exactly once"]["result"] == "MISS"
    assert any(note.startswith("cluster: 50000 runs per drain, 3 round(s); 600000 sharded runs checked")
               for note in harness.notes(results))  # fmt: skip


def test_the_cluster_lateness_run_gives_its_own_rows_beside_the_one_valkey_run(harness: ModuleType) -> None:
    def steady(start_p99: float, fire_p99: float) -> dict[str, object]:
        return {"mode": "steady", "start": {"p50_ms": 5.0, "p99_ms": start_p99, "max_ms": 90.0},
                "fire": {"p50_ms": 1.0, "p99_ms": fire_p99}, "slots_expected": 100, "slots_started": 100}  # fmt: skip

    results: dict[str, object] = {
        "lateness": {"figures": steady(20.0, 4.0), "error": ""},
        "lateness-cluster": {"figures": steady(60.0, 12.0), "error": ""},
    }
    harness.lateness_figures(results)
    rows = by_figure(harness.build_rows(results))
    assert results["lateness"]["figures"]["fire_p99_ms_cluster"] == 12.0  # type: ignore[index]
    start = rows["lateness p99 on the Valkey Cluster (3-shard queue, 1,000 per-second cron)"]
    assert (start["value"], start["floor"], start["result"]) == (60.0, 20.0, "MISS")
    assert rows["lateness p99"]["value"] == 20.0  # the one-Valkey row keeps its own figure


def test_history_rows_judge_the_hot_path_against_1m_rows_and_retention_under_a_second(harness: ModuleType) -> None:
    figures = {"claim_us": 70.0, "complete_us": 90.0, "floor_claim_us": 60.0, "floor_complete_us": 70.0,
               "retention_day_s": 0.4, "floor_retention_day_s": 0.05, "generated_rows_per_s": 80000,
               "database_gb": 52.0, "rows": 100_000_000, "floor_rows": 1_000_000, "days": 30, "generate_s": 1250.0,
               "loaders": 2,
               "heap_gb": 20.0, "index_gb": 32.0, "schema_identical": True, "open_day_kept": True,
               "claim_batch_ms_rounds": [14.0, 15.0, 13.0], "floor_claim_batch_ms_rounds": [12.0, 12.5, 11.0],
               "complete_batch_ms_rounds": [18.0], "floor_complete_batch_ms_rounds": [14.0]}  # fmt: skip
    results = {"history": {"figures": figures, "error": ""}}
    rows = by_figure(harness.build_rows(results))
    claim = rows["history of 100,000,000 rows: claim per execution (batches of 200)"]
    assert claim["ratio"] == pytest.approx(70 / 60)
    assert claim["result"] == "pass"  # within 1.2x the 1,000,000-row figure
    assert claim["target"] == "≤ 1.2× floor"  # noqa: RUF001
    completion = rows["history of 100,000,000 rows: completion per execution"]
    assert completion["ratio"] == pytest.approx(90 / 70)
    assert completion["result"] == "MISS"  # 1.29x
    day = rows["history of 100,000,000 rows: retention of a day (detach + drop, 3.3M rows)"]
    assert (day["value"], day["floor"], day["result"]) == (0.4, 0.05, "pass")  # judged on the value: < 1 s
    figures["retention_day_s"] = 1.2
    assert by_figure(harness.build_rows(results))[day["figure"]]["result"] == "MISS"
    assert rows["history: rows generated/s (straight into the day partitions)"]["result"] == ""  # informative
    assert any(note.startswith("history: 100,000,000 rows over 30 days, generated in 1250.0 s by 2 connections")
               and "schema as migrated: yes" in note and "(1,000,000 rows: [12.0, 12.5, 11.0])" in note
               for note in harness.notes(results))  # fmt: skip


def test_the_history_measurement_has_a_quick_variant_with_small_sizes(harness: ModuleType) -> None:
    (history,) = [m for m in harness.MEASUREMENTS if m.name == "history"]
    assert (ROOT / "bench" / history.script).exists()
    full, quick = (
        dict(zip(history.args[::2], history.args[1::2], strict=True)),
        dict(zip(history.quick[::2], history.quick[1::2], strict=True)),
    )
    assert (int(full["--history"]), int(full["--floor"])) == (100_000_000, 1_000_000)
    assert int(quick["--history"]) <= 1_000_000
    assert int(quick["--floor"]) < int(quick["--history"])
