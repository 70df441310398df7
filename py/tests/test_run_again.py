"""A cell or a script run again: a second `Run` in one process finishes the first, said
in both logs and on stderr (with `finish_previous=False` the second is refused), and
a `log=` path holding an earlier run's log is kept, the new run logging beside it."""

from __future__ import annotations

import pytest

import headroom

from conftest import Viewer, kinds


def test_a_second_run_finishes_the_first_and_both_logs_say_so(tmp_path, capsys):
    first = headroom.Run("nb", log=tmp_path / "a.jsonl")
    viewer = Viewer(first.socket)
    first.report(1.5)
    first.report(1.25)
    # The notebook cell again, without finish(): the new run finishes the old one.
    second = headroom.Run("nb", log=tmp_path / "b.jsonl")
    assert first.ended and not second.ended
    said = capsys.readouterr().err
    assert "the previous run 'nb'" in said and "at step 2" in said, said
    # The first run's dashboard saw why it ended, then its end.
    note = viewer.until(lambda r: r["kind"] == "notice" and "new run" in r.get("text", ""))
    assert "finished by a new run ('nb')" in note["text"], note
    viewer.until(lambda r: r["kind"] == "finished")
    viewer.close()
    second.report(0.5)
    second.finish()

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    (finished,) = kinds(a, "finished")
    assert finished["steps_done"] == 2, finished
    assert any("finished by a new run" in n["text"] for n in kinds(a, "notice"))
    assert any("previous run 'nb'" in n["text"] for n in kinds(b, "notice"))
    assert len(kinds(b, "step")) == 1


def test_finish_previous_false_keeps_the_refusal():
    first = headroom.Run("first")
    with pytest.raises(headroom.RunError, match=r"\('first'\) is already active"):
        headroom.Run("second", finish_previous=False)
    assert not first.ended, "a refused run leaves the first one going"
    first.report(0.5)
    first.finish()


def test_a_log_holding_an_earlier_run_is_kept_and_the_next_name_used(tmp_path):
    log = tmp_path / "gpt.jsonl"
    with headroom.Run("gpt", log=log) as run:
        run.report(1.0)
    before = log.read_text()
    with headroom.Run("gpt", log=log) as run:
        assert run.log_path == str(tmp_path / "gpt-2.jsonl")
        run.report(2.0)
    assert log.read_text() == before, "the first run's log is untouched"
    (step,) = kinds(tmp_path / "gpt-2.jsonl", "step")
    assert step["loss"] == 2.0
    notes = [n["text"] for n in kinds(tmp_path / "gpt-2.jsonl", "notice")]
    assert any("holds an earlier run's log, kept" in t for t in notes), notes


def test_a_compressed_rotated_log_holds_every_step_once_and_cat_reads_the_chain(tmp_path):
    """`log="….jsonl.zst"` with `log_rotate=` writes zstd-framed segments beside the live
    file; `headroom cat` prints the chain in order; a second run takes the next free name
    (segments beside a name make it taken)."""
    import json
    import random
    import string
    import subprocess

    from conftest import headroom_bin

    log = tmp_path / "gpt.jsonl.zst"
    # Notices that do not compress fill 1 MiB segments fast through the same log path.
    with headroom.Run("gpt", log=log, log_rotate="1MiB") as run:
        for i in range(500):
            noise = "".join(random.Random(i).choices(string.ascii_lowercase, k=4000))
            run.notice(f"{i:05d} {noise}")
            run.report(float(i))
    segments = sorted(p.name for p in tmp_path.glob("gpt.*.jsonl.zst"))
    # About 1.4 MB on disk: one or two closed segments, numbered from 1.
    assert segments and segments == sorted(
        f"gpt.{n}.jsonl.zst" for n in range(1, len(segments) + 1)
    ), segments
    out = subprocess.run([headroom_bin(), "cat", str(log)], capture_output=True, check=True)
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 501))
    assert [r["loss"] for r in records if r["kind"] == "step"][:3] == [0.0, 1.0, 2.0]
    with headroom.Run("gpt", log=log) as again:
        assert again.log_path == str(tmp_path / "gpt-2.jsonl.zst")
    with pytest.raises(ValueError, match="30min"):
        headroom.Run("bad", log=tmp_path / "x.jsonl", log_rotate="30m")
    with pytest.raises(ValueError, match="give log= too"):
        headroom.Run("bad", log_rotate="1d")
