//! Sentences that explain a difference between the taps a manifest declares and the taps the
//! data holds: constant shifts, permutations, embedding taps, moved slots, and which pair of
//! layer-id conventions turns the one into the other.

use tandem_wiring::{Convention, RawIds, TapId, format_taps};

/// `d` with `observed[i] = declared[i] + d` blocks for every slot, if there is one (`d != 0`).
pub fn constant_shift(declared: &[TapId], observed: &[TapId]) -> Option<i64> {
    if declared.len() != observed.len() || declared.is_empty() {
        return None;
    }
    let mut shift = None;
    for (d, o) in declared.iter().zip(observed) {
        let delta = o.residual_position()? as i64 - d.residual_position()? as i64;
        if *shift.get_or_insert(delta) != delta {
            return None;
        }
    }
    shift.filter(|&d| d != 0)
}

/// One way ids written in one convention and read in another produce the observed taps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConventionSwap {
    /// The ids, as written.
    pub ids: Vec<i64>,
    /// Conventions in which these ids mean the declared taps.
    pub written_in: Vec<Convention>,
    /// Conventions in which the same ids mean the observed taps.
    pub read_as: Vec<Convention>,
}

fn names(cs: &[Convention]) -> String {
    cs.iter().map(|c| c.name()).collect::<Vec<_>>().join("/")
}

impl ConventionSwap {
    /// `a hf/vllm/eagle id read as a sglang-classic/specforge id`.
    pub fn short(&self) -> String {
        format!(
            "a {} id read as a {} id",
            names(&self.written_in),
            names(&self.read_as)
        )
    }

    /// The full sentence.
    pub fn sentence(&self, declared: &[TapId], observed: &[TapId]) -> String {
        format!(
            "ids {:?} mean {} in {} ({}), but read as {} ({}) they mean {}: exactly what the \
             data holds",
            self.ids,
            format_taps(declared),
            names(&self.written_in),
            self.written_in[0].meaning(),
            names(&self.read_as),
            self.read_as[0].meaning(),
            format_taps(observed),
        )
    }
}

/// Every (write, read) convention pair that turns `declared` into `observed`, grouped by the
/// id list. When the manifest recorded the raw ids it was requested with, those come first.
pub fn convention_swaps(
    declared: &[TapId],
    observed: &[TapId],
    num_layers: usize,
    raw: Option<&RawIds>,
) -> Vec<ConventionSwap> {
    let mut out: Vec<ConventionSwap> = Vec::new();
    if declared == observed {
        return out;
    }
    let mut add = |ids: Vec<i64>, writer: Convention, reader: Convention| match out
        .iter_mut()
        .find(|s| s.ids == ids)
    {
        Some(s) => {
            if !s.written_in.contains(&writer) {
                s.written_in.push(writer);
            }
            if !s.read_as.contains(&reader) {
                s.read_as.push(reader);
            }
        }
        None => out.push(ConventionSwap {
            ids,
            written_in: vec![writer],
            read_as: vec![reader],
        }),
    };
    let reads_as_observed = |c: Convention, ids: &[i64]| {
        c.to_canonical(ids, num_layers)
            .is_ok_and(|taps| taps == observed)
    };
    if let Some(raw) = raw {
        for reader in Convention::ALL {
            if reader != raw.convention && reads_as_observed(reader, &raw.ids) {
                add(raw.ids.clone(), raw.convention, reader);
            }
        }
    }
    for writer in Convention::ALL {
        let Ok(ids) = writer.from_canonical(declared, num_layers) else {
            continue;
        };
        for reader in Convention::ALL {
            if reader != writer && reads_as_observed(reader, &ids) {
                add(ids.clone(), writer, reader);
            }
        }
    }
    out
}

/// List-level sentences about `observed` (what the data holds) against `declared` (what the
/// manifest says), most specific first. Empty when they agree.
pub fn describe_pattern(
    declared: &[TapId],
    observed: &[TapId],
    num_layers: usize,
    raw: Option<&RawIds>,
) -> Vec<String> {
    let mut out = Vec::new();
    if declared == observed {
        return out;
    }
    if let Some(shift) = constant_shift(declared, observed) {
        let unit = if shift.abs() == 1 { "block" } else { "blocks" };
        out.push(format!(
            "every slot holds the tap {shift:+} {unit} from what the manifest says: the data is \
             {} but the manifest says {} (a layer-id convention mismatch or off-by-one)",
            format_taps(observed),
            format_taps(declared)
        ));
    } else if declared.len() == observed.len() && {
        let mut a = declared.to_vec();
        let mut b = observed.to_vec();
        a.sort();
        b.sort();
        a == b
    } {
        out.push(format!(
            "permuted slots: the data holds the manifest's taps in another order, {} instead of \
             {}; the fc weights of a head trained on it expect the data's order",
            format_taps(observed),
            format_taps(declared)
        ));
    }
    let has_embed = |taps: &[TapId]| taps.contains(&TapId::Embed);
    match (has_embed(declared), has_embed(observed)) {
        (false, true) => out.push(format!(
            "extra embedding tap: the data holds embed, which the manifest {} does not name (a \
             head trained on [embed, a, b] but served [a, b, c] loses most of its acceptance)",
            format_taps(declared)
        )),
        (true, false) => out.push(format!(
            "missing embedding tap: the manifest names embed in {} but the data holds no \
             embedding",
            format_taps(declared)
        )),
        _ => {}
    }
    let n = declared.len();
    if n == observed.len() && n > 1 {
        if observed[1..] == declared[..n - 1] {
            out.push("the data's slots are the manifest's moved one slot later".to_owned());
        } else if observed[..n - 1] == declared[1..] {
            out.push("the data's slots are the manifest's moved one slot earlier".to_owned());
        }
    }
    for swap in convention_swaps(declared, observed, num_layers, raw)
        .iter()
        .take(3)
    {
        out.push(swap.sentence(declared, observed));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(ks: &[usize]) -> Vec<TapId> {
        ks.iter().map(|&k| TapId::Block(k)).collect()
    }

    #[test]
    fn plus_one_is_an_hf_index_read_as_an_sglang_id() {
        let swaps = convention_swaps(&blocks(&[1, 14, 26]), &blocks(&[2, 15, 27]), 30, None);
        let swap = swaps
            .iter()
            .find(|s| s.ids == [2, 15, 27])
            .expect("hf ids read as sglang");
        assert!(swap.written_in.contains(&Convention::Vllm), "{swap:?}");
        assert!(
            swap.read_as.contains(&Convention::SglangClassic),
            "{swap:?}"
        );
        assert_eq!(
            constant_shift(&blocks(&[1, 14, 26]), &blocks(&[2, 15, 27])),
            Some(1)
        );
    }

    #[test]
    fn recorded_raw_ids_come_first() {
        let raw = RawIds::new(Convention::SglangHeuristic, vec![1, 14, 26]);
        let swaps = convention_swaps(&blocks(&[1, 14, 26]), &blocks(&[0, 13, 25]), 30, Some(&raw));
        assert_eq!(swaps[0].ids, [1, 14, 26]);
        assert_eq!(swaps[0].written_in[0], Convention::SglangHeuristic);
        assert!(swaps[0].read_as.contains(&Convention::Vllm));
    }

    #[test]
    fn patterns_are_named() {
        let declared = blocks(&[1, 3, 4]);
        let permuted = blocks(&[3, 1, 4]);
        let p = describe_pattern(&declared, &permuted, 8, None).join(" | ");
        assert!(p.contains("permuted slots"), "{p}");
        let embed = vec![TapId::Embed, TapId::Block(1), TapId::Block(3)];
        let p = describe_pattern(&declared, &embed, 8, None).join(" | ");
        assert!(
            p.contains("extra embedding tap") && p.contains("one slot later"),
            "{p}"
        );
        assert!(describe_pattern(&declared, &declared, 8, None).is_empty());
    }
}
