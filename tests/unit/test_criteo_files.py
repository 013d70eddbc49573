"""Raw Criteo TSV files: converted by TorchRec's own utilities, cached, read as batches."""

import os
import pickle

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils, InMemoryBinaryCriteoIterDataPipe

from criteo_rows import SIZES, make_rows, write_tsv
from lightning_sparselift.data import CriteoDataModule, criteo
from lightning_sparselift.data.criteo import CriteoFormatError, convert_tsv, scan_tsv, split_rows
from lightning_sparselift.data.loading import BatchedRecDataset


def expected_arrays(rows):
    """What the conversion must give, written out independently of TorchRec: missing -> 0,
    ids int(hex, 16), dense log(x - min(file) + 2) in float32."""
    ints = np.array([[0 if v is None else v for v in r[1]] for r in rows], dtype=np.int64)
    ids = np.array([[0 if c is None else int(c, 16) for c in r[2]] for r in rows], dtype=np.int64)
    labels = np.array([[r[0]] for r in rows], dtype=np.int32)
    dense = np.log((ints - ints.min() + 2).astype(np.float32))
    return dense, ids, labels, ints


def load_triple(prefix):
    return [np.load(f"{prefix}_{k}.npy") for k in ("dense", "sparse", "labels")]


def torchrec_reference(tsv, out):
    """TorchRec's conversion of the same file, called directly."""
    prefix = out / tsv.name
    BinaryCriteoUtils.tsv_to_npys(str(tsv), *(f"{prefix}_{k}.npy" for k in ("dense", "sparse", "labels")))
    return prefix


def same_batch(ours, theirs):
    assert torch.equal(ours.dense, theirs.dense_features)
    assert torch.equal(ours.labels, theirs.labels.float())
    assert ours.sparse.keys() == theirs.sparse_features.keys()
    assert torch.equal(ours.sparse.values(), theirs.sparse_features.values().long())
    assert torch.equal(ours.sparse.lengths(), theirs.sparse_features.lengths())


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of TorchRec's conversion."""
    calls = []
    original = BinaryCriteoUtils.tsv_to_npys

    def counting(in_file, *args, **kwargs):
        calls.append(in_file)
        return original(in_file, *args, **kwargs)

    monkeypatch.setattr(BinaryCriteoUtils, "tsv_to_npys", staticmethod(counting))
    return calls


@pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")
def test_conversion_and_batches_match_torchrec(tmp_path, counted):
    # three "days": train on day_0 + day_1 (a batch crosses the file boundary), val/test = the
    # halves of day_2 (odd: val gets the extra row), as TorchRec's Terabyte reader splits them
    rows = {d: make_rows(n, seed=d) for d, n in enumerate((37, 30, 25))}
    days = [write_tsv(tmp_path / f"day_{d}", r) for d, r in rows.items()]
    ref = tmp_path / "ref"
    ref.mkdir()
    refs = [torchrec_reference(p, ref) for p in days]
    counted.clear()

    dm = CriteoDataModule(batch_size=16, criteo_tsv=[str(p) for p in days], rows_per_feature=SIZES,
                          cache_dir=str(tmp_path / "cache"))
    dm.prepare_data()
    assert counted == [str(p) for p in days]
    for d, (day, reference) in enumerate(zip(days, refs)):
        got = convert_tsv(day, tmp_path / "cache")
        assert not got.converted and got.rows == len(rows[d])
        ours, theirs = load_triple(got.prefix), load_triple(reference)
        for a, b in zip(ours, theirs):  # bit-identical to TorchRec's own output
            assert a.dtype == b.dtype and np.array_equal(a, b)
        dense, ids, labels, ints = expected_arrays(rows[d])
        assert np.array_equal(ours[0], dense) and np.array_equal(ours[1], ids) and np.array_equal(ours[2], labels)
        # TorchRec's dense transform is log(x - min(file) + 2), here log(x + 5), not log(x + 1)
        assert ints.min() == -3 and np.array_equal(ours[0], np.log((ints + 5).astype(np.float32)))
        assert (ids == 0).any() and (ints == 0).any()  # missing fields became 0

    for stage, files in (("train", refs[:2]), ("val", refs[2:]), ("test", refs[2:])):
        theirs = list(InMemoryBinaryCriteoIterDataPipe(
            stage, [f"{p}_dense.npy" for p in files], [f"{p}_sparse.npy" for p in files],
            [f"{p}_labels.npy" for p in files], batch_size=16, rank=0, world_size=1, hashes=SIZES))
        ours = BatchedRecDataset(dm.split(stage), 16)
        assert len(ours) == len(theirs)
        for i, batch in enumerate(theirs):
            same_batch(ours[i], batch)
    assert (len(dm.split("train")), len(dm.split("val")), len(dm.split("test"))) == (67, 13, 12)
    assert counted == [str(p) for p in days]  # split() found everything in the cache


def test_datamodule_single_file_batches_and_cache_reuse(tmp_path, counted):
    tsv = write_tsv(tmp_path / "train.txt", make_rows(70, seed=3))
    cache = tmp_path / "cache"
    dm = CriteoDataModule(batch_size=8, criteo_tsv=str(tsv), max_rows=500, cache_dir=str(cache))
    dm.prepare_data()
    assert len(counted) == 1
    dm.setup("fit")
    train_end, val_end = split_rows(70)
    assert (train_end, val_end) == (60, 65)
    assert (len(dm.split("train")), len(dm.split("val")), len(dm.split("test"))) == (60, 5, 5)
    batches = list(dm.train_dataloader())
    assert len(batches) == 60 // 8  # training drops the short last batch
    for batch in batches:
        kjt = batch.sparse
        assert kjt.keys() == dm.feature_names and torch.all(kjt.lengths() == 1)
        for key, values in zip(kjt.keys(), kjt.values().split(kjt.length_per_key())):
            assert 0 <= int(values.min()) and int(values.max()) < dm.table_sizes[int(key.split("_")[1])]
        assert torch.isfinite(batch.dense).all() and set(batch.labels.tolist()) <= {0.0, 1.0}
    assert sum(len(b) for b in dm.val_dataloader()) == 5

    npys = sorted(cache.rglob("*.npy"))
    assert len(npys) == 3
    mtimes = [p.stat().st_mtime_ns for p in npys]
    again = CriteoDataModule(batch_size=8, criteo_tsv=[str(tsv)], max_rows=500, cache_dir=str(cache))
    again.prepare_data()
    again.setup("fit")
    assert len(counted) == 1, "the cached conversion is reused"
    assert [p.stat().st_mtime_ns for p in sorted(cache.rglob("*.npy"))] == mtimes
    assert torch.equal(again.split("val").batch(0, 5).dense, dm.split("val").batch(0, 5).dense)

    st = tsv.stat()  # the file changed (new mtime): converted again, into a new cache entry
    os.utime(tsv, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    CriteoDataModule(batch_size=8, criteo_tsv=str(tsv), max_rows=500, cache_dir=str(cache)).prepare_data()
    assert len(counted) == 2 and len(list(cache.rglob("source.json"))) == 2


def test_explicit_splits_crlf_and_no_final_newline(tmp_path):
    rows = make_rows(20, seed=7)
    crlf = write_tsv(tmp_path / "a.tsv", rows, newline="\r\n", final_newline=False)
    plain = write_tsv(tmp_path / "b.tsv", rows)
    for a, b in zip(load_triple(convert_tsv(crlf, tmp_path / "c").prefix),
                    load_triple(convert_tsv(plain, tmp_path / "c").prefix)):
        assert np.array_equal(a, b)
    dm = CriteoDataModule(batch_size=8, criteo_tsv={"train": [str(crlf), str(plain)], "val": str(plain)},
                          rows_per_feature=SIZES, cache_dir=str(tmp_path / "c"))
    assert len(dm.split("train")) == 40 and len(dm.split("val")) == 20
    with pytest.raises(ValueError, match="no files for split 'test'"):
        dm.split("test")
    with pytest.raises(ValueError, match="not both"):
        CriteoDataModule(criteo_tsv=str(plain), criteo_npy_dir=str(tmp_path))
    with pytest.raises(ValueError, match="26 table sizes"):
        CriteoDataModule(criteo_tsv=str(plain), rows_per_feature=[10, 10])


def _edit(rows, line, column, value):
    text = write_tsv_text(rows).split("\n")
    fields = text[line - 1].split("\t")
    if value is None:
        del fields[column]
    elif column is None:
        fields.append(value)
    else:
        fields[column] = value
    text[line - 1] = "\t".join(fields)
    return "\n".join(text)


def write_tsv_text(rows):
    return "\n".join("\t".join([str(label)] + ["" if v is None else str(v) for v in ints]
                               + ["" if c is None else c for c in cats]) for label, ints, cats in rows) + "\n"


BAD = {  # name: (file text from the good rows, expected message)
    "missing field": (lambda r: _edit(r, 3, 20, None), r"bad\.tsv:3: 39 tab-separated fields, expected 40"),
    "extra field": (lambda r: _edit(r, 2, None, "0"), r"bad\.tsv:2: 41 tab-separated fields"),
    "blank line": (lambda r: write_tsv_text(r[:4]) + "\n" + write_tsv_text(r[4:]), r"bad\.tsv:5: empty line"),
    "unlabeled": (lambda r: "".join(line.split("\t", 1)[1] + "\n" for line in write_tsv_text(r).splitlines()),
                  r"bad\.tsv:1: 39 tab-separated fields.*unlabeled"),
    "float": (lambda r: _edit(r, 4, 5, "1.5"), r"bad\.tsv:4: unexpected character b'\.'"),
    "not hex": (lambda r: _edit(r, 6, 30, "zz00ff00"), r"bad\.tsv:6: unexpected character b'z'"),
    "lone CR": (lambda r: _edit(r, 2, 3, "1\r2"), r"bad\.tsv:2: carriage return not followed by a newline"),
    "hex in integer": (lambda r: _edit(r, 5, 2, "1a"), (r"bad\.tsv:5: column 3 \(integer feature 1\) is '1a', "
                                                        "not a decimal integer")),
    "dash id": (lambda r: _edit(r, 7, 14, "-"), r"bad\.tsv:7: column 15 \(categorical feature 0\) is '-', not a hex"),
    "int32 overflow": (lambda r: _edit(r, 8, 13, "3000000000"), (r"bad\.tsv:8: column 14 \(integer feature 12\) is "
                                                                  "3000000000, outside int32")),
    "label 2": (lambda r: _edit(r, 9, 0, "2"), r"bad\.tsv:9: label 2, expected 0 or 1"),
    "shift overflow": (lambda r: _edit(r, 4, 1, str(2**31 - 1)), (r"bad\.tsv:4: an integer feature overflows "
                                                                  "TorchRec's int32 shift")),
    "empty file": (lambda r: "", r"bad\.tsv: the file is empty"),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered in log")
@pytest.mark.parametrize("chunk", [7, 1 << 22], ids=["tiny-chunks", "one-chunk"])
@pytest.mark.parametrize("case", list(BAD))
def test_malformed_file_raises_clear_error(tmp_path, monkeypatch, case, chunk):
    monkeypatch.setattr(criteo, "_CHUNK", chunk)  # the numpy scan must not depend on chunk boundaries
    make, message = BAD[case]
    bad = tmp_path / "bad.tsv"
    bad.write_text(make(make_rows(10, seed=1)), newline="")
    cache = tmp_path / "cache"
    dm = CriteoDataModule(criteo_tsv=[str(bad)], cache_dir=str(cache))
    with pytest.raises(CriteoFormatError, match=message):
        dm.prepare_data()
    # nothing is marked converted, nothing half-written is left behind
    assert not list(cache.rglob("source.json")) and not list(cache.rglob("*.npy"))
    with pytest.raises(CriteoFormatError) as again:
        dm.prepare_data()
    copy = pickle.loads(pickle.dumps(again.value))
    assert str(copy) == str(again.value) and copy.path == str(bad)


def test_scan_counts_rows_across_chunks(tmp_path, monkeypatch):
    rows = make_rows(9, seed=2)
    tsv = write_tsv(tmp_path / "day_0", rows, newline="\r\n")
    blank = tmp_path / "blank"
    lines = tsv.read_bytes().split(b"\r\n")
    blank.write_bytes(b"\r\n".join(lines[:3] + [b""] + lines[3:]))  # line 4 is empty
    cr_end = tmp_path / "cr_end"
    cr_end.write_bytes(tsv.read_bytes() + b"\r")
    for chunk in (1, 2, 3, 5, 64, 1 << 22):
        monkeypatch.setattr(criteo, "_CHUNK", chunk)
        assert scan_tsv(tsv) == 9
        with pytest.raises(CriteoFormatError, match="blank:4: empty line"):
            scan_tsv(blank)
        with pytest.raises(CriteoFormatError, match="cr_end:10: carriage return"):
            scan_tsv(cr_end)


def test_missing_files(tmp_path):
    dm = CriteoDataModule(criteo_tsv=[str(tmp_path / "day_0"), str(tmp_path / "day_1")], cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"day_0.*day_1"):
        dm.prepare_data()
    with pytest.raises(FileNotFoundError, match="day_0"):
        dm.split("train")
