"""The wire schema (egomem.serving.wire) against the model repository's config.pbtxt files, the per-row
error codes, and the shared serving pieces that carry them (StepBatch, SlotTable)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from egomem.serving import wire
from egomem.serving.adapter import StepBatch, cohort_errors
from egomem.serving.streams import SlotTable, StreamError

REPO = Path(__file__).resolve().parents[1] / "model_repository"


def _tensors(block: str) -> dict[str, str]:
    return dict(re.findall(r'name:\s*"(\w+)",\s*data_type:\s*(TYPE_\w+)', block))


def test_config_pbtxt_agrees_with_the_wire_schema():
    for model, (inputs, outputs) in wire.TENSORS.items():
        text = (REPO / model / "config.pbtxt").read_text()
        have_in = _tensors(text[text.index("input ["):text.index("output [")])
        have_out = _tensors(text[text.index("output ["):text.index("sequence_batching")])
        assert have_in == inputs, model
        assert have_out == outputs, model


def test_row_errors_round_trip_by_code():
    text = wire.format_row_error(wire.RowError.NO_FREE_SLOT, "no free stream slot: all 4 are open")
    assert wire.parse_row_error(text) == (wire.RowError.NO_FREE_SLOT, "no free stream slot: all 4 are open")
    assert wire.parse_row_error("") is None
    assert wire.parse_row_error("something else: x") == (wire.RowError.INTERNAL, "something else: x")


def test_step_batch_reports_each_rows_code():
    batch = StepBatch()
    batch.add(0, "a", [1])
    batch.add(0, "b", [1])  # a second row on stream 1
    batch.add(0, "c", [2], error="bad shape")
    batch.add(0, "d", [3])
    results = ["served", None, StreamError("full", wire.RowError.NO_FREE_SLOT)]
    rows = batch.results_of(0, results)
    assert rows[0] == ("served", None)
    assert rows[1][1][0] is wire.RowError.DUPLICATE_ROW and rows[2][1] == (wire.RowError.BAD_INPUT, "bad shape")
    assert rows[3][1] == (wire.RowError.NO_FREE_SLOT, "full")
    errors = [wire.parse_row_error(e.decode()) for e in cohort_errors(rows)[0]]
    assert errors[0] is None and [e[0] for e in errors[1:]] == [wire.RowError.DUPLICATE_ROW, wire.RowError.BAD_INPUT,
                                                                 wire.RowError.NO_FREE_SLOT]


def test_slot_table_reclaims_idle_streams():
    table, released = SlotTable("test"), []
    table.put(7, 0)
    table.put(8, 1)
    time.sleep(0.06)
    table.touch(8)
    table.reclaim_idle(0.05, lambda s: released.append(table.pop(s)))
    assert released == [0] and 7 not in table and table[8] == 1 and len(table) == 1
    assert np.array_equal(sorted(table.items()), [(8, 1)])


def test_gateway_maps_row_codes_to_close_codes():
    from egomem import protocol as P
    from egomem.orchestrator.gateway import row_failure

    full = row_failure("mimi_codec", wire.RowError.NO_FREE_SLOT, "no free stream slot: all 64 are open")
    assert full.close_code == P.CLOSE_TRY_LATER and str(full) == "no free stream slot in mimi_codec"
    bad = row_failure("dialog_lm", wire.RowError.UNKNOWN_STREAM, "unknown stream 5")
    assert bad.close_code == P.CLOSE_INTERNAL and str(bad) == "dialog_lm refused the stream: unknown stream 5"
