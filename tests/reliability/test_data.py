"""Bad data (issue 24, item 5): invalid UTF-8, empty prompts, null labels and many bad lines are reported up
front with file:line (the first MAX_REPORTED, then a count); a full disk names the path and leaves no
truncated file behind."""

from __future__ import annotations

import errno
import json
import os

import pytest

from rlbench.data import DataConfig, PromptDataset, build_tokenizer, write_jsonl
from rlbench.data.datasets import MAX_REPORTED, DataError
from rlbench.metrics import JsonlSink


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _good(i: int) -> bytes:
    return (json.dumps({"prompt": f"{i}+1=?", "label": str(i + 1)}) + "\n").encode()


def test_non_utf8_byte_names_file_line_and_column(tmp_path, tok):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(_good(0) + b'{"prompt": "caf\xe9", "label": "1"}\n' + _good(2))
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte b'\\xe9' at column 16\); "
                                         r"re-encode the file as UTF-8"):
        PromptDataset(DataConfig(path=str(path)), tok)


def test_empty_prompt_and_null_label_are_load_errors_not_rollout_errors(tmp_path, tok):
    path = tmp_path / "empty.jsonl"
    rows = [{"prompt": "1+1=?", "label": "2"}, {"prompt": "  ", "label": "3"}, {"prompt": "2+2=?", "label": None},
            {"prompt": [{"role": "user", "content": ""}], "label": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as info:
        PromptDataset(DataConfig(path=str(path)), tok)
    msg = str(info.value)
    assert "empty.jsonl: 3 bad lines of 4" in msg
    assert "empty.jsonl:2: empty prompt 'prompt'='  '" in msg and "empty.jsonl:4: empty prompt" in msg
    assert "empty.jsonl:3: null label 'label'" in msg and "label_key=None" in msg
    assert "max_seq_len" not in msg
    with pytest.raises(DataError) as info:  # without labels only the empty prompts are errors
        PromptDataset(DataConfig(path=str(path), label_key=None), tok)
    assert len(info.value.problems) == 2 and "null label" not in str(info.value)


def test_every_bad_line_is_counted_the_first_ones_listed(tmp_path, tok):
    path = tmp_path / "many.jsonl"
    lines = [_good(i) if i % 3 else b"{broken\n" for i in range(60)]  # lines 1, 4, 7, ... are bad: 20 of 60
    path.write_bytes(b"".join(lines))
    with pytest.raises(DataError) as info:
        PromptDataset(DataConfig(path=str(path)), tok)
    msg, err = str(info.value), info.value
    assert len(err.problems) == 20 and msg.startswith(f"{path}: 20 bad lines of 60:")
    assert "many.jsonl:1: invalid JSON" in msg and f"many.jsonl:{3 * (MAX_REPORTED - 1) + 1}: invalid JSON" in msg
    assert f"many.jsonl:{3 * MAX_REPORTED + 1}:" not in msg and f"... and {20 - MAX_REPORTED} more" in msg
    assert "fix or remove these lines" in msg


class _FullDisk:
    """A file whose writes fail with ENOSPC after `n_ok` successful ones (a disk that fills up)."""

    def __init__(self, f, n_ok: int) -> None:
        self.f, self.n_ok = f, n_ok

    def write(self, text):
        if self.n_ok <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.n_ok -= 1
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_disk_full_during_write_jsonl_names_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "data" / "train.jsonl"
    old = [{"prompt": "1+1=?", "label": "2"}]
    write_jsonl(old, path)
    import rlbench.data.tasks as tasks

    monkeypatch.setattr(tasks, "open", lambda *a, **k: _FullDisk(open(*a, **k), 2), raising=False)
    with pytest.raises(OSError, match=rf"cannot write 5 rows to '{path}': No space left on device; free disk space") as info:
        write_jsonl([{"prompt": f"{i}+1=?", "label": str(i + 1)} for i in range(5)], path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert [json.loads(x) for x in path.read_text().splitlines()] == old  # the previous file is intact
    assert os.listdir(path.parent) == ["train.jsonl"]  # no half-written temp file left behind


def test_disk_full_in_the_metrics_file_names_the_path(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write({"train/loss": 1.0}, step=1)
    sink.file = _FullDisk(sink.file, 0)
    with pytest.raises(OSError, match=r"cannot append step 2 to the metrics file '.*metrics\.jsonl': No space left"):
        sink.write({"train/loss": 0.5}, step=2)
    sink.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "train/loss": 1.0}
