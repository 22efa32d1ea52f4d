"""`prepare` over worker processes writes what one process writes, byte for byte: the corpus's
order is the inputs', whatever worker finishes first."""

from support.runs import stdlib_glob

from jaxllm.data.prepare import prepare


def test_two_workers_write_what_one_process_writes(tmp_path):
    inputs = [stdlib_glob("email"), stdlib_glob("json")]  # 25 files: 25 work units
    for workers in (1, 2):
        prepare(inputs, "gpt2", tmp_path / f"w{workers}", val_fraction=0.3, workers=workers, progress=False)
    written = {w: {p.relative_to(tmp_path / w): p.read_bytes() for p in (tmp_path / w).rglob("*") if p.is_file()}
               for w in ("w1", "w2")}  # fmt: skip
    assert len(written["w1"]) >= 3 and written["w1"] == written["w2"]
