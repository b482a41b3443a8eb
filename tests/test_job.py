"""The job every torchrun rank must agree on (dpq.autoround.job, dpq.planning.distributed.agree_job), without
processes: what is compared (as auto-round parses it; model and data by content), what is not
(per-rank settings), and the refusal naming each differing setting and rank. End to end under
torchrun: tests/test_torchrun_stop.py."""

from __future__ import annotations

import shutil

import pytest

from dpq.autoround import job
from dpq.autoround.args import split_argv
from dpq.demo.embedded import DATA_DIR
from dpq.planning.distributed import JobMismatch, ProcessSet, agree_job


class Gathered(ProcessSet):
    """The agreement without processes: every rank's settings given (the others drew no token)."""

    def __init__(self, rank: int, values: list) -> None:
        super().__init__(rank, len(values), store=None)
        self.values = values

    def all_gather_object(self, value):
        return [value if r == self.rank else ("", v) for r, v in enumerate(self.values)]


def _settings(*argv: str) -> dict:
    ours, rest = split_argv(["--model", str(DATA_DIR), "--parallel_quantization", "1", *argv])
    return job.settings(ours, rest, None)


def test_one_job_however_it_is_spelled():
    same = _settings("--iters", "4", "--output_dir", "a", "--device_map", "0", "--parallel_devices", "cpu")
    assert same == _settings("--iters=4", "--output_dir", "b", "--device", "1", "--parallel_report", "r.json")
    assert _settings() == _settings("--seed", "42")  # auto-round's default, given or not
    assert _settings("--iters", "5") != same and _settings("--parallel_debug") != _settings()
    assert "--output_dir" not in same and "--device_map" not in same and "--parallel_timeout" not in same


def test_a_local_model_counts_by_its_content(tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(DATA_DIR, copy)
    (copy / ".cache").mkdir()
    (copy / ".cache" / "lock").write_text("a host's own")  # hidden entries are not the model
    assert job.content_digest(copy) == job.content_digest(DATA_DIR)
    a = _settings()
    b = job.settings(*split_argv(["--model", str(copy), "--parallel_quantization", "1"]), None)
    assert a["--model"][0] == b["--model"][0] and a["--model"][1] != b["--model"][1]  # same content, shown apart
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 1
    weights.write_bytes(data)
    assert job.content_digest(copy) != job.content_digest(DATA_DIR)


def test_a_large_file_is_sampled_with_its_header(tmp_path, monkeypatch):
    monkeypatch.setattr(job, "FULL_BYTES", 1 << 10)
    monkeypatch.setattr(job, "SAMPLE_BYTES", 64)
    monkeypatch.setattr(job, "SAMPLE_EVERY", 1 << 10)
    f = tmp_path / "w.safetensors"
    header = b'{"w": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}}'
    body = bytearray(len(header).to_bytes(8, "little") + header + bytes(8192))
    f.write_bytes(body)
    digest = job.content_digest(f)
    assert 8 + len(header) < 1000
    for at, seen in ((8 + 5, True), (len(body) - 10, True), (2048 + 10, True),
                     (2048 - 500, False)):  # between samples: the price of a cheap digest
        changed = bytearray(body)
        changed[at] ^= 1
        f.write_bytes(changed)
        assert (job.content_digest(f) != digest) is seen, at


def test_the_ranks_must_agree_on_the_whole_job():
    a, b = _settings("--iters", "4"), _settings("--iters", "5", "--dataset", str(DATA_DIR / "corpus_train.txt"))
    first = Gathered(0, [a, a])
    agree_job(first, a)
    assert first.job  # rank 0 drew the job's token
    with pytest.raises(JobMismatch) as refused:
        agree_job(Gathered(1, [a, b, a]), b)
    reasons = refused.value.reasons
    assert reasons[0].startswith("--dataset differs (rank 0, 2: None; rank 1: ") and "(content " in reasons[0]
    assert reasons[1] == "--iters differs (rank 0, 2: 4; rank 1: 5)" and len(reasons) == 2
    assert str(refused.value).startswith("dpq: the ranks were given different jobs") and "Fix: " in str(refused.value)
    agree_job(Gathered(0, [a, None]), a)  # a rank auto-round's parser rejects stops there itself


def test_arguments_auto_round_rejects_are_left_to_it(capsys):
    assert _settings("--iters", "four") is None and _settings("--help") is None
    assert capsys.readouterr() == ("", "")  # auto-round's parser says it, once, when it runs


def test_a_data_file_counts_by_its_bytes_not_its_name(tmp_path):
    """Issue 31, item 3: rank 1 given a byte-identical copy of the dataset under another name agreed
    (the digest hashed the file's name with its bytes)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "the same bytes"}\n')
    renamed = tmp_path / "rank1_copy.jsonl"
    shutil.copy(data, renamed)
    assert job.content_digest(renamed) == job.content_digest(data)
    a, b = _settings("--dataset", str(data)), _settings("--dataset", str(renamed))
    assert a["--dataset"][0] == b["--dataset"][0] and a["--dataset"][1] != b["--dataset"][1]
    agree_job(Gathered(0, [a, b]), a)  # no mismatch
    renamed.write_text('{"text": "other bytes!!"}\n')  # the same size, other bytes: still told apart
    assert job.content_digest(renamed) != job.content_digest(data)


@pytest.mark.parametrize("spelled", ["01", " 1", "1"])
def test_the_world_compares_by_its_meaning(spelled):
    """Issue 31, item 11: ``--parallel_quantization 01`` on one rank and ``1`` on another is one world."""
    ours, rest = split_argv(["--model", str(DATA_DIR), "--parallel_quantization", spelled])
    mine = job.settings(ours, rest, None)
    other = _settings()  # --parallel_quantization 1
    assert mine["--parallel_quantization"][0] == other["--parallel_quantization"][0]
    agree_job(Gathered(0, [other, mine]), other)
    assert _settings()["--parallel_quantization"][0] != job.settings(
        *split_argv(["--model", str(DATA_DIR), "--parallel_quantization", "2"]), None)["--parallel_quantization"][0]
