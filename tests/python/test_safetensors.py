"""load_safetensors / save_safetensors against the file format itself: files
built byte by byte here (u64 little-endian header length, JSON header, data)
including bf16 bits produced by torch, and written files parsed back by hand."""
import json
import struct

import numpy as np
import pytest
import torch

import attnkit
from torch_ref import rng

NP_OF = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32,
         "I64": np.int64, "BOOL": np.bool_}


def build_file(path, entries, metadata=None, pad=0):
    """Writes a .safetensors file by hand. entries: list of (name, dtype
    string, shape, raw bytes), laid out in order after `pad` junk bytes."""
    header, data, offset = {}, bytearray(b"\0" * pad), pad
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    if metadata is not None:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + bytes(data))


def parse_file(path):
    """The reverse, by hand: {name: (dtype, shape, bytes)}, metadata."""
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    meta = header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}, meta


def test_round_trip_every_dtype_and_rank(tmp_path):
    g = rng(0)
    tensors = {
        "scalar": np.array(2.5, dtype=np.float32),
        "f32": g.standard_normal((3, 4)).astype(np.float32),
        "f64": g.standard_normal((2, 3, 4)),
        "f16": g.standard_normal((5,)).astype(np.float16),
        "i32": g.integers(-9, 9, size=(2, 2, 2, 2)).astype(np.int32),
        "i64": g.integers(-2**40, 2**40, size=(3,)),
        "bool": g.random((4, 1)) < 0.5,
        "empty": np.zeros((0, 3), dtype=np.float32),
        # A non-contiguous view is written as its logical contents.
        "strided": g.standard_normal((4, 6)).astype(np.float32)[:, ::2].T,
    }
    path = tmp_path / "t.safetensors"
    attnkit.save_safetensors(path, tensors, metadata={"format": "pt", "x": "1"})
    loaded, meta = attnkit.load_safetensors(str(path), return_metadata=True)
    assert meta == {"format": "pt", "x": "1"}
    assert set(loaded) == set(tensors)
    for name, want in tensors.items():
        got = loaded[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    # The bytes on disk are the format's: little-endian, row-major.
    entries, meta2 = parse_file(path)
    assert meta2 == meta
    assert entries["f64"][0] == "F64" and entries["f64"][2] == tensors["f64"].tobytes()
    assert entries["strided"][2] == np.ascontiguousarray(tensors["strided"]).tobytes()
    assert entries["bool"][0] == "BOOL" and entries["scalar"][1] == ()


def test_hand_built_file_with_bf16_and_unaligned_offsets(tmp_path):
    """bf16 bits from torch load as exactly torch's float32 widening; tensors
    at odd byte offsets (the format allows any) load correctly."""
    g = rng(1)
    x = torch.from_numpy(g.standard_normal((3, 5)).astype(np.float32))
    bf = x.to(torch.bfloat16)
    bf_bytes = bf.view(torch.int16).numpy().astype("<i2").tobytes()
    f16 = g.standard_normal((7,)).astype("<f2")
    f32 = g.standard_normal((2, 3)).astype("<f4")
    path = tmp_path / "hand.safetensors"
    build_file(path, [("w.bf16", "BF16", (3, 5), bf_bytes), ("b.f16", "F16", (7,), f16.tobytes()),
                      ("c.f32", "F32", (2, 3), f32.tobytes())], metadata={"m": "n"}, pad=1)
    loaded = attnkit.load_safetensors(path)
    assert loaded["w.bf16"].dtype == np.float32
    np.testing.assert_array_equal(loaded["w.bf16"], bf.float().numpy())
    assert not np.array_equal(loaded["w.bf16"], x.numpy())  # really rounded
    np.testing.assert_array_equal(loaded["b.f16"], f16)
    np.testing.assert_array_equal(loaded["c.f32"], f32)


@pytest.mark.parametrize("corrupt", ["header_too_long", "offset_past_end", "bad_dtype",
                                     "shape_mismatch", "not_json"])
def test_malformed_files_raise_value_error(tmp_path, corrupt):
    path = tmp_path / "bad.safetensors"
    raw = np.ones(4, dtype="<f4").tobytes()
    if corrupt == "header_too_long":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif corrupt == "not_json":
        path.write_bytes(struct.pack("<Q", 5) + b"{nope")
    else:
        header = {"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
        if corrupt == "offset_past_end":
            header["t"]["data_offsets"] = [0, 32]
        elif corrupt == "bad_dtype":
            header["t"]["dtype"] = "Q7"
        elif corrupt == "shape_mismatch":
            header["t"]["shape"] = [5]
        h = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(h)) + h + raw)
    with pytest.raises(ValueError, match="^load_safetensors: "):
        attnkit.load_safetensors(path)


def test_io_errors_and_bad_arguments(tmp_path):
    with pytest.raises(OSError, match="cannot open"):
        attnkit.load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"tensors\['u'\] has dtype uint8"):
        attnkit.save_safetensors(tmp_path / "x.safetensors", {"u": np.zeros(3, np.uint8)})
    with pytest.raises(ValueError, match="metadata must map str to str"):
        attnkit.save_safetensors(tmp_path / "x.safetensors", {"a": np.zeros(3)}, {"k": 1})
    with pytest.raises(ValueError, match="rank 0 to 4"):
        attnkit.save_safetensors(tmp_path / "x.safetensors", {"a": np.zeros((1,) * 5)})
    with pytest.raises(ValueError, match="path must be"):
        attnkit.load_safetensors(3.5)
    assert not (tmp_path / "x.safetensors").exists()  # failed saves write nothing
