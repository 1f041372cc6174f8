"""`report_to="trackio"` (local, no Space) and `report_to="wandb"` (offline) through the real
trainer (scripted samples and evaluations, no server): what each tracker writes on disk is read
back; nothing leaves tmp_path or touches the network. Both are dev extras (a missing one fails
here rather than skipping). Without the last evaluation logged before train end, trackio lost it."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.train.test_evaluation_schedule import EVAL_SPLIT, run_trainer, scripted_eval  # noqa: F401


def test_trackio_logs_locally_every_logged_window_and_the_evaluations(tmp_path, scripted_eval, monkeypatch):  # noqa: F811
    from trackio import sqlite_storage

    store = tmp_path / "trackio"
    store.mkdir()
    monkeypatch.setattr(sqlite_storage, "TRACKIO_DIR", store)  # read once at import
    trainer = run_trainer(tmp_path / "out", scripted_eval, steps=3, eval_dataset=EVAL_SPLIT,
                          eval_strategy="steps", eval_steps=2, eval_on_start=True,
                          report_to="trackio", project="grpo-agent-test", run_name="r1")
    assert list(store.glob("*.db")), "trackio wrote nothing under its local folder"
    logged = [row for row in trainer.state.log_history if "loss" in row]
    rows = sqlite_storage.SQLiteStorage.get_logs("grpo-agent-test", "r1")

    def series(key):  # trackio numbers its own steps (one per log call), so values are compared
        return [row[key] for row in rows if row.get(key) is not None]

    assert series("train/loss") == [pytest.approx(row["loss"], rel=1e-5) for row in logged]
    assert series("train/eval/model_version") == [0.0, 2.0, 3.0]


def wandb_history(run_file: Path) -> list[dict[str, str]]:
    """The history rows of an offline `.wandb` file (key -> JSON text). No reader ships with
    wandb 0.31, so this reads its framing: a 7-byte `:W&B` header, then LevelDB-log records
    (checksum, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, payload, rows = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B", f"{run_file} is not a wandb run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): item.value_json
                             for item in record.history.item})
    return rows


def test_wandb_offline_run_holds_every_logged_window_and_the_evaluations(tmp_path, scripted_eval, monkeypatch):  # noqa: F811
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name, folder in (("WANDB_DIR", "."), ("WANDB_CACHE_DIR", "cache"),  # debug logs go here
                         ("WANDB_CONFIG_DIR", "config"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(name, str(tmp_path / folder))
    try:
        trainer = run_trainer(tmp_path / "out", scripted_eval, steps=3, eval_dataset=EVAL_SPLIT,
                              eval_strategy="steps", eval_steps=2, eval_on_start=True,
                              report_to="wandb")
        wandb.finish()  # the callback leaves the run open (it ends at exit)
    finally:
        wandb.teardown()  # its wandb-core service would otherwise live until pytest exits
    (run_file,) = tmp_path.rglob("offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    logged = [row for row in trainer.state.log_history if "loss" in row]

    def series(key):
        return [float(row[key]) for row in history if key in row]

    assert series("train/loss") == [pytest.approx(row["loss"], rel=1e-5) for row in logged]
    assert series("train/eval/model_version") == [0.0, 2.0, 3.0]
