#!/usr/bin/env python3
"""Reads a `tandem dump` directory with pyarrow AND polars and prints a JSON summary per row.

Used by crates/tandem-dump/tests/dump.rs (pyarrow_and_polars_read_the_files), which compares
the summary with what the Rust reader sees. Also a reference for reading dumps from Python:
bf16 hidden states are UInt16 bit patterns, widened with `(bits.astype(uint32) << 16).view(f32)`.

Usage: scripts/check_dump.py DIR   (needs pyarrow, polars, numpy)
"""
import glob
import json
import os
import sys

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc as ipc

COLUMNS = ["sample_id", "source_index", "input_ids", "loss_mask", "aux_hidden", "last_hidden"]


def field_meta(field):
    return {k.decode(): v.decode() for k, v in (field.metadata or {}).items()}


def widen(flat, dtype):
    """Hidden-state elements (a pyarrow array) to float32 numpy."""
    if dtype == "bf16":
        assert flat.type == pa.uint16(), flat.type
        bits = flat.to_numpy(zero_copy_only=False).astype(np.uint32) << 16
        return bits.view(np.float32)
    assert dtype == "f16" and flat.type == pa.float16(), (dtype, flat.type)
    return flat.to_numpy(zero_copy_only=False).astype(np.float32)


def hidden(table, column, row, dtype, width):
    tokens = table.column(column)[row].values  # FixedSizeListArray, one item per token
    assert tokens.type.list_size == width, (tokens.type, width)
    return widen(tokens.flatten(), dtype).reshape(len(tokens), width)


def main(directory):
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    shards = sorted(glob.glob(os.path.join(directory, "shard-*.arrow")))
    rows = []
    for path in shards:
        with open(path, "rb") as f:
            reader = ipc.open_file(f)
            schema = reader.schema
            table = reader.read_all()
        assert schema.names == COLUMNS, schema.names
        meta = {k.decode(): v.decode() for k, v in schema.metadata.items()}
        assert meta["tandem.format"] == "tandem-dump/1", meta["tandem.format"]
        wiring = json.loads(meta["tandem.wiring"])
        assert wiring["taps"] == manifest["wiring"]["taps"], (wiring["taps"], manifest["wiring"]["taps"])
        assert wiring["tap_point"] == "residual-stream"
        assert wiring["producer"]["execution_path"] == "prefill"
        identity = json.loads(meta["tandem.manifest"])
        assert identity["dataset"] == manifest["dataset"]
        aux_meta = field_meta(schema.field("aux_hidden"))
        last_meta = field_meta(schema.field("last_hidden"))
        dtype = aux_meta["tandem.dtype"]
        assert dtype == manifest["dtype"] == last_meta["tandem.dtype"] == wiring["dtype"]
        aux_width = int(aux_meta["tandem.width"])
        width = int(last_meta["tandem.width"])
        assert aux_width == manifest["num_slots"] * manifest["hidden_size"]
        assert aux_meta["tandem.taps"].split(",") == manifest["wiring"]["taps"]
        assert last_meta["tandem.taps"] == manifest["last_hidden_tap"]

        # polars reads the same file: same rows, ids, masks and hidden-state bits.
        df = pl.read_ipc(path)
        assert df.columns == COLUMNS, df.columns
        assert df.height == table.num_rows
        assert df["input_ids"].to_list() == table.column("input_ids").to_pylist()
        assert df["loss_mask"].to_list() == table.column("loss_mask").to_pylist()
        assert df["sample_id"].to_list() == table.column("sample_id").to_pylist()

        for i in range(table.num_rows):
            ids = table.column("input_ids")[i].values.to_numpy()
            mask = table.column("loss_mask")[i].values.to_numpy()
            aux = hidden(table, "aux_hidden", i, dtype, aux_width)
            last = hidden(table, "last_hidden", i, dtype, width)
            assert aux.shape == (len(ids), aux_width) and last.shape == (len(ids), width)
            pl_first = np.array(df["aux_hidden"][i][0].to_list())
            pa_first = table.column("aux_hidden")[i].values[0].values.to_numpy(zero_copy_only=False)
            assert np.array_equal(pl_first.astype(pa_first.dtype), pa_first), "polars != pyarrow"
            rows.append({
                "sample_id": table.column("sample_id")[i].as_py(),
                "source_index": table.column("source_index")[i].as_py(),
                "tokens": int(len(ids)),
                "ids_sum": int(ids.astype(np.int64).sum()),
                "mask_sum": int(mask.astype(np.int64).sum()),
                "aux_sum": float(aux.astype(np.float64).sum()),
                "last_sum": float(last.astype(np.float64).sum()),
                "aux_head": [float(x) for x in aux[0, :4]],
                "last_tail": [float(x) for x in last[-1, -4:]],
            })
    print(json.dumps({
        "pyarrow": pa.__version__,
        "polars": pl.__version__,
        "shards": len(shards),
        "rows": rows,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
