//! The Arrow layout of a shard: one record batch per sample, six columns.
//!
//! | column         | Arrow type                                   | per row                      |
//! |----------------|----------------------------------------------|------------------------------|
//! | `sample_id`    | `Utf8`                                       | the dataset's id             |
//! | `source_index` | `UInt64`                                     | record ordinal in the dataset|
//! | `input_ids`    | `List<UInt32>`                               | n token ids                  |
//! | `loss_mask`    | `List<UInt8>`                                | n flags, 1 = assistant token |
//! | `aux_hidden`   | `List<FixedSizeList<UInt16 \| Float16, S*T>>` | n rows of the S taps concatenated in slot order |
//! | `last_hidden`  | `List<FixedSizeList<UInt16 \| Float16, T>>`   | n rows of block L-1          |
//!
//! `UInt16` holds bfloat16 bit patterns (`tandem.dtype = bf16`), `Float16` IEEE halves
//! (`tandem.dtype = f16`). Field metadata of the two hidden columns: `tandem.dtype`,
//! `tandem.taps` (canonical tap ids, comma-separated) and `tandem.width`. Schema metadata:
//! `tandem.format` (`tandem-dump/1`), `tandem.wiring` (the [`tandem_wiring::WiringManifest`]
//! JSON) and `tandem.manifest` (the [`DumpManifest`] identity JSON). The IPC footer's custom
//! metadata `tandem.shard` holds the shard's [`crate::ShardInfo`] (counts and record range),
//! written when the shard is complete.

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::builder::{StringBuilder, UInt64Builder};
use arrow_array::types::{UInt8Type, UInt32Type};
use arrow_array::{
    Array, ArrayRef, FixedSizeListArray, Float16Array, ListArray, PrimitiveArray, RecordBatch,
    StringArray, UInt8Array, UInt16Array, UInt32Array, UInt64Array,
};
use arrow_buffer::{OffsetBuffer, ScalarBuffer};
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Schema, SchemaRef};
use half::{bf16, f16};
use tandem_wiring::TapId;

use crate::manifest::{DumpManifest, FORMAT_NAME, FORMAT_VERSION, StorageDtype};
use crate::reader::DumpRecord;

/// Column names, in schema order.
pub const COLUMNS: [&str; 6] = [
    "sample_id",
    "source_index",
    "input_ids",
    "loss_mask",
    "aux_hidden",
    "last_hidden",
];
/// Schema metadata key: `tandem-dump/<version>`.
pub const META_FORMAT: &str = "tandem.format";
/// Schema metadata key: the wiring manifest JSON.
pub const META_WIRING: &str = "tandem.wiring";
/// Schema metadata key: the dump manifest's identity JSON (no counts).
pub const META_MANIFEST: &str = "tandem.manifest";
/// Footer custom metadata key: the shard's [`crate::ShardInfo`] JSON.
pub const META_SHARD: &str = "tandem.shard";
/// Field metadata key: `bf16` or `f16`.
pub const META_DTYPE: &str = "tandem.dtype";
/// Field metadata key: the taps of the column, canonical, comma-separated.
pub const META_TAPS: &str = "tandem.taps";
/// Field metadata key: width of one token's row.
pub const META_WIDTH: &str = "tandem.width";

/// Shapes of one dump's hidden-state columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub dtype: StorageDtype,
    pub hidden_size: usize,
    pub num_slots: usize,
    pub aux_taps: Vec<TapId>,
    pub last_tap: TapId,
}

fn join_taps(taps: &[TapId]) -> String {
    taps.iter()
        .map(TapId::canonical)
        .collect::<Vec<_>>()
        .join(",")
}

impl Layout {
    pub fn of(manifest: &DumpManifest) -> Self {
        Layout {
            dtype: manifest.dtype,
            hidden_size: manifest.hidden_size,
            num_slots: manifest.num_slots,
            aux_taps: manifest.wiring.taps.clone(),
            last_tap: manifest.last_hidden_tap,
        }
    }

    pub fn aux_width(&self) -> usize {
        self.num_slots * self.hidden_size
    }

    fn element_type(&self) -> DataType {
        match self.dtype {
            StorageDtype::Bf16 => DataType::UInt16,
            StorageDtype::F16 => DataType::Float16,
        }
    }

    fn element_field(&self) -> FieldRef {
        Arc::new(Field::new("item", self.element_type(), false))
    }

    fn token_field(&self, width: usize) -> FieldRef {
        Arc::new(Field::new(
            "item",
            DataType::FixedSizeList(self.element_field(), width as i32),
            false,
        ))
    }

    fn hidden_field(&self, name: &str, width: usize, taps: &[TapId]) -> Field {
        let metadata = HashMap::from([
            (META_DTYPE.to_owned(), self.dtype.as_str().to_owned()),
            (META_TAPS.to_owned(), join_taps(taps)),
            (META_WIDTH.to_owned(), width.to_string()),
        ]);
        Field::new(name, DataType::List(self.token_field(width)), false).with_metadata(metadata)
    }

    /// The shard schema, with `manifest`'s wiring and identity in its metadata.
    pub fn schema(&self, manifest: &DumpManifest) -> SchemaRef {
        let list = |t: DataType| DataType::List(Arc::new(Field::new("item", t, false)));
        let fields = vec![
            Field::new(COLUMNS[0], DataType::Utf8, false),
            Field::new(COLUMNS[1], DataType::UInt64, false),
            Field::new(COLUMNS[2], list(DataType::UInt32), false),
            Field::new(COLUMNS[3], list(DataType::UInt8), false),
            self.hidden_field(COLUMNS[4], self.aux_width(), &self.aux_taps),
            self.hidden_field(COLUMNS[5], self.hidden_size, &[self.last_tap]),
        ];
        let metadata = HashMap::from([
            (
                META_FORMAT.to_owned(),
                format!("{FORMAT_NAME}/{FORMAT_VERSION}"),
            ),
            (
                META_WIRING.to_owned(),
                serde_json::to_string(&manifest.wiring).expect("a manifest always serialises"),
            ),
            (META_MANIFEST.to_owned(), manifest.identity_json()),
        ]);
        Arc::new(Schema::new_with_metadata(fields, metadata))
    }

    /// Checks that a shard's columns have exactly this layout's types (metadata aside).
    pub fn check_schema(&self, schema: &Schema) -> Result<(), String> {
        let expected = self.schema_types();
        if schema.fields().len() != expected.len() {
            return Err(format!(
                "{} columns, expected {} ({})",
                schema.fields().len(),
                expected.len(),
                COLUMNS.join(", ")
            ));
        }
        for (field, (name, ty)) in schema.fields().iter().zip(&expected) {
            if field.name() != name || !field.data_type().equals_datatype(ty) {
                return Err(format!(
                    "column {:?} of type {} where {name:?} of type {ty} was expected",
                    field.name(),
                    field.data_type()
                ));
            }
            if let Some(dtype) = field.metadata().get(META_DTYPE)
                && dtype != self.dtype.as_str()
            {
                return Err(format!(
                    "column {name:?} says dtype {dtype}, the manifest {}",
                    self.dtype
                ));
            }
        }
        Ok(())
    }

    fn schema_types(&self) -> Vec<(&'static str, DataType)> {
        let list = |t: DataType| DataType::List(Arc::new(Field::new("item", t, false)));
        vec![
            (COLUMNS[0], DataType::Utf8),
            (COLUMNS[1], DataType::UInt64),
            (COLUMNS[2], list(DataType::UInt32)),
            (COLUMNS[3], list(DataType::UInt8)),
            (
                COLUMNS[4],
                DataType::List(self.token_field(self.aux_width())),
            ),
            (
                COLUMNS[5],
                DataType::List(self.token_field(self.hidden_size)),
            ),
        ]
    }

    /// One sample as a one-row record batch.
    pub fn encode(
        &self,
        schema: &SchemaRef,
        record: &DumpRecord,
        source_index: u64,
    ) -> Result<RecordBatch, ArrowError> {
        let n = record.input_ids.len();
        let check = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(ArrowError::InvalidArgumentError(format!(
                    "sample {:?}: {what} has {got} values, expected {want}",
                    record.sample_id
                )))
            }
        };
        check("loss_mask", record.loss_mask.len(), n)?;
        check("aux_hidden", record.aux_hidden.len(), n * self.aux_width())?;
        check(
            "last_hidden",
            record.last_hidden.len(),
            n * self.hidden_size,
        )?;

        let mut id = StringBuilder::new();
        id.append_value(&record.sample_id);
        let mut index = UInt64Builder::new();
        index.append_value(source_index);
        let columns: Vec<ArrayRef> = vec![
            Arc::new(id.finish()),
            Arc::new(index.finish()),
            Arc::new(one_row_list(
                Arc::new(UInt32Array::from(record.input_ids.clone())),
                DataType::UInt32,
            )),
            Arc::new(one_row_list(
                Arc::new(UInt8Array::from(record.loss_mask.clone())),
                DataType::UInt8,
            )),
            Arc::new(self.hidden_list(&record.aux_hidden, self.aux_width())?),
            Arc::new(self.hidden_list(&record.last_hidden, self.hidden_size)?),
        ];
        RecordBatch::try_new(schema.clone(), columns)
    }

    fn hidden_list(&self, values: &[f32], width: usize) -> Result<ListArray, ArrowError> {
        let elements: ArrayRef = match self.dtype {
            StorageDtype::Bf16 => Arc::new(UInt16Array::from(encode_bf16(values))),
            StorageDtype::F16 => Arc::new(Float16Array::from(encode_f16(values))),
        };
        let tokens =
            FixedSizeListArray::try_new(self.element_field(), width as i32, elements, None)?;
        let n = tokens.len();
        ListArray::try_new(
            self.token_field(width),
            OffsetBuffer::new(ScalarBuffer::from(vec![0i32, n as i32])),
            Arc::new(tokens),
            None,
        )
    }

    /// Row `row` of a batch back to a record (hidden states widened to f32).
    pub fn decode(&self, batch: &RecordBatch, row: usize) -> Result<DumpRecord, String> {
        let column = |i: usize| batch.column(i).as_ref();
        let sample_id = column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .ok_or("sample_id is not Utf8")?
            .value(row)
            .to_owned();
        let _ = column(1)
            .as_any()
            .downcast_ref::<UInt64Array>()
            .ok_or("source_index is not UInt64")?;
        let input_ids = list_values::<UInt32Type>(column(2), row, "input_ids")?;
        let loss_mask = list_values::<UInt8Type>(column(3), row, "loss_mask")?;
        let aux_hidden = self.hidden_values(column(4), row, self.aux_width(), "aux_hidden")?;
        let last_hidden = self.hidden_values(column(5), row, self.hidden_size, "last_hidden")?;
        let n = input_ids.len();
        if loss_mask.len() != n
            || aux_hidden.len() != n * self.aux_width()
            || last_hidden.len() != n * self.hidden_size
        {
            return Err(format!(
                "sample {sample_id:?}: {n} tokens but {} mask flags, {} aux values (width {}), \
                 {} last-hidden values (width {})",
                loss_mask.len(),
                aux_hidden.len(),
                self.aux_width(),
                last_hidden.len(),
                self.hidden_size
            ));
        }
        Ok(DumpRecord {
            sample_id,
            input_ids,
            loss_mask,
            aux_hidden,
            last_hidden,
        })
    }

    fn hidden_values(
        &self,
        array: &dyn Array,
        row: usize,
        width: usize,
        name: &str,
    ) -> Result<Vec<f32>, String> {
        let list = array
            .as_any()
            .downcast_ref::<ListArray>()
            .ok_or_else(|| format!("{name} is not a list"))?;
        let tokens = list.value(row);
        let tokens = tokens
            .as_any()
            .downcast_ref::<FixedSizeListArray>()
            .ok_or_else(|| format!("{name} items are not fixed-size lists"))?;
        if tokens.value_length() as usize != width {
            return Err(format!(
                "{name} rows are {} wide, expected {width}",
                tokens.value_length()
            ));
        }
        // Slicing a fixed-size list slices its child too, so the values start at 0.
        let (start, len) = (0, tokens.len() * width);
        let values = tokens.values();
        match self.dtype {
            StorageDtype::Bf16 => {
                let v = values
                    .as_any()
                    .downcast_ref::<UInt16Array>()
                    .ok_or_else(|| format!("{name} elements are not UInt16 (bf16 bits)"))?;
                Ok(decode_bf16(&v.values()[start..start + len]))
            }
            StorageDtype::F16 => {
                let v = values
                    .as_any()
                    .downcast_ref::<Float16Array>()
                    .ok_or_else(|| format!("{name} elements are not Float16"))?;
                Ok(v.values()[start..start + len]
                    .iter()
                    .map(|x| x.to_f32())
                    .collect())
            }
        }
    }
}

fn one_row_list(values: ArrayRef, ty: DataType) -> ListArray {
    let n = values.len() as i32;
    ListArray::new(
        Arc::new(Field::new("item", ty, false)),
        OffsetBuffer::new(ScalarBuffer::from(vec![0i32, n])),
        values,
        None,
    )
}

fn list_values<T: arrow_array::ArrowPrimitiveType>(
    array: &dyn Array,
    row: usize,
    name: &str,
) -> Result<Vec<T::Native>, String> {
    let list = array
        .as_any()
        .downcast_ref::<ListArray>()
        .ok_or_else(|| format!("{name} is not a list"))?;
    let values = list.value(row);
    let values = values
        .as_any()
        .downcast_ref::<PrimitiveArray<T>>()
        .ok_or_else(|| format!("{name} has the wrong element type"))?;
    Ok(values.values().to_vec())
}

/// f32 to bfloat16 bit patterns, rounding to nearest-even (NaN stays NaN).
pub fn encode_bf16(values: &[f32]) -> Vec<u16> {
    values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect()
}

/// bfloat16 bit patterns to f32 (exact).
pub fn decode_bf16(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// f32 to IEEE half, rounding to nearest-even (values beyond 65504 become infinite).
pub fn encode_f16(values: &[f32]) -> Vec<f16> {
    values.iter().map(|&v| f16::from_f32(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_is_exact_for_bf16_values_and_rounds_to_nearest_even() {
        let values = [0.0f32, -1.5, 3.0e38, 1.0e-30, 65504.0, 1.0 + 1.0 / 256.0];
        let bits = encode_bf16(&values);
        let back = decode_bf16(&bits);
        assert_eq!(back[0], 0.0);
        assert_eq!(back[1], -1.5);
        // 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0).
        assert_eq!(back[5], 1.0);
        for (v, b) in values.iter().zip(&back) {
            assert!((v - b).abs() <= v.abs() / 128.0, "{v} -> {b}");
        }
        assert_eq!(
            encode_bf16(&back),
            bits,
            "bf16 values survive a second round trip"
        );
    }
}
