//! `tandem compare`: offline acceptance (the head teacher-forced on a dump through the training
//! unroll) next to online acceptance (the speculative engine on prompts), per draft position.
//! A large gap between the two is itself the symptom of a wiring fault (facts 6.9: offline
//! accuracy 0.8-0.9 with an online accept length of ~1.5).
//!
//! Offline, for a sample of `n` tokens and TTT step `i` at index `t` (step `i` at `t` predicts
//! token `t + 2 + i`, see `Eagle3Draft::forward_ttt`):
//!
//! - the target's argmax at `t + 1 + i` comes from the dumped `last_hidden` through the
//!   target's final norm and lm_head (as the trainer recomputes it);
//! - `correct_i(t)` = the draft argmax mapped through `d2t` equals that argmax;
//! - `acc_i` = share of correct positions over positions with `loss_mask[t + i] == 1` and
//!   `t + 1 + i < n` (the training denominator);
//! - the chain view: at positions `t` where every step is defined and `loss_mask[t] == 1`,
//!   draft position `i` is "reached" when steps `0..i` were all correct and "accepted" when
//!   step `i` is too: the per-position acceptance of a chain drafter fed these exact hidden
//!   states, comparable to the engine's `AcceptanceStats::per_position`; the implied accept
//!   length is `1 + mean(accepted drafts)`.

use std::fmt::Write as _;

use burn::prelude::*;
use serde::Serialize;
use tandem_dump::DumpReader;
use tandem_eagle::Eagle3Draft;
use tandem_infer::{AcceptanceStats, SpecConfig, SpecEngine};
use tandem_model::{TapRequest, TargetModel};

use crate::error::ReplayError;
use crate::render::{escape, html_page};

/// Offline acceptance counts over a dump.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OfflineAcceptance {
    /// Samples used.
    pub samples: usize,
    /// Per step: positions counted for `acc_i`.
    pub denominators: Vec<usize>,
    /// Per step: correct positions.
    pub correct: Vec<usize>,
    /// Chain positions (every step defined, loss mask on).
    pub chain_positions: usize,
    /// Per draft position: chain positions that reached it.
    pub reached: Vec<usize>,
    /// Per draft position: chain positions that accepted it.
    pub accepted: Vec<usize>,
}

impl OfflineAcceptance {
    /// An empty tally for `steps` draft steps.
    pub fn new(steps: usize) -> Self {
        OfflineAcceptance {
            denominators: vec![0; steps],
            correct: vec![0; steps],
            reached: vec![0; steps],
            accepted: vec![0; steps],
            ..Default::default()
        }
    }

    /// Adds one sample. `draft[i][t]`: the target id step `i` proposes at index `t` (draft
    /// argmax through `d2t`); `argmax[u]`: the target's argmax after tokens `0..=u`.
    pub fn add_sample(&mut self, draft: &[Vec<u32>], argmax: &[u32], loss_mask: &[u8]) {
        let n = argmax.len();
        let steps = self.correct.len();
        let correct = |i: usize, t: usize| draft[i][t] == argmax[t + 1 + i];
        for i in 0..steps {
            for t in 0..n {
                let u = t + i;
                if u + 1 >= n || loss_mask[u] == 0 {
                    continue;
                }
                self.denominators[i] += 1;
                self.correct[i] += usize::from(correct(i, t));
            }
        }
        for (t, &mask) in loss_mask.iter().enumerate().take(n) {
            if t + steps >= n || mask == 0 {
                continue;
            }
            self.chain_positions += 1;
            for i in 0..steps {
                self.reached[i] += 1;
                if !correct(i, t) {
                    break;
                }
                self.accepted[i] += 1;
            }
        }
        self.samples += 1;
    }

    /// `acc_i` per step.
    pub fn acc(&self) -> Vec<f64> {
        ratio(&self.correct, &self.denominators)
    }

    /// Conditional acceptance per draft position along a chain.
    pub fn per_position(&self) -> Vec<f64> {
        ratio(&self.accepted, &self.reached)
    }

    /// `1 + mean accepted drafts` over chain positions.
    pub fn implied_accept_length(&self) -> f64 {
        if self.chain_positions == 0 {
            return 0.0;
        }
        1.0 + self.accepted.iter().sum::<usize>() as f64 / self.chain_positions as f64
    }
}

fn ratio(a: &[usize], b: &[usize]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&a, &b)| if b == 0 { 0.0 } else { a as f64 / b as f64 })
        .collect()
}

/// Runs the head teacher-forced on the first `max_samples` samples of `dump`.
pub fn offline_acceptance<B: Backend>(
    model: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    dump: &DumpReader,
    steps: usize,
    max_samples: Option<usize>,
) -> Result<OfflineAcceptance, ReplayError> {
    let m = dump.manifest();
    let (t_width, aux_width) = (m.hidden_size, m.aux_width());
    let device = model.device().clone();
    let mut out = OfflineAcceptance::new(steps);
    let count = dump.len().min(max_samples.unwrap_or(usize::MAX));
    if count == 0 {
        return Err(ReplayError::EmptyDump {
            dir: dump.dir().to_owned(),
        });
    }
    for index in 0..count {
        let record = dump.read(index)?;
        let n = record.len();
        if n < 2 {
            continue;
        }
        let last = Tensor::<B, 3>::from_data(
            TensorData::new(record.last_hidden.clone(), [1, n, t_width]),
            &device,
        );
        let argmax: Vec<u32> = ints(model.logits_from_last_block(last).argmax(2));
        let aux = Tensor::<B, 3>::from_data(
            TensorData::new(record.aux_hidden.clone(), [1, n, aux_width]),
            &device,
        );
        let proposals = teacher_forced_proposals(draft, aux, &record.input_ids, steps)?;
        out.add_sample(&proposals, &argmax, &record.loss_mask);
    }
    Ok(out)
}

/// The head teacher-forced on one sequence: `aux: [1, n, num_taps * T]`, `input_ids: [n]`.
/// `out[i][t]` is the target id TTT step `i` proposes at index `t` (draft argmax through
/// `d2t`), the `draft` argument of [`OfflineAcceptance::add_sample`].
pub fn teacher_forced_proposals<B: Backend>(
    draft: &Eagle3Draft<B>,
    aux: Tensor<B, 3>,
    input_ids: &[u32],
    steps: usize,
) -> Result<Vec<Vec<u32>>, ReplayError> {
    let n = input_ids.len();
    let outputs = draft.forward_ttt(aux, input_ids, &[n], steps)?;
    Ok(outputs
        .into_iter()
        .map(|o| draft.to_target_ids(&ints(o.logits.argmax(2))))
        .collect())
}

pub(crate) fn ints<B: Backend>(t: Tensor<B, 3, Int>) -> Vec<u32> {
    t.into_data()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("ints")
        .into_iter()
        .map(|v| v as u32)
        .collect()
}

/// Online acceptance of the speculative engine (chain drafting, greedy) over prompts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OnlineAcceptance {
    /// Prompts run.
    pub prompts: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// The engine's statistics.
    pub stats: AcceptanceStats,
}

/// Runs `prompts` one at a time through [`SpecEngine`] with a greedy chain of `steps` drafts,
/// the serving taps `taps`.
pub fn online_acceptance<B: Backend>(
    model: &TargetModel<B>,
    draft: &Eagle3Draft<B>,
    taps: TapRequest,
    prompts: &[Vec<u32>],
    steps: usize,
    max_new_tokens: usize,
    stop_ids: &[u32],
) -> Result<OnlineAcceptance, ReplayError> {
    let engine = SpecEngine {
        target: model,
        draft,
        taps,
        config: SpecConfig::chain(steps),
    };
    let mut stats = AcceptanceStats::new(steps);
    let mut tokens = 0;
    for prompt in prompts {
        let out = engine.generate(std::slice::from_ref(prompt), max_new_tokens, stop_ids)?;
        for seq in out.sequences {
            tokens += seq.tokens.len();
            stats.merge(&seq.stats);
        }
    }
    Ok(OnlineAcceptance {
        prompts: prompts.len(),
        tokens,
        stats,
    })
}

/// Offline next to online acceptance, and whether the gap is suspicious.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareReport {
    /// The dump.
    pub dump: String,
    /// The head.
    pub head: String,
    /// The prompt set.
    pub prompts: String,
    /// Draft steps compared.
    pub steps: usize,
    /// Offline counts.
    pub offline: OfflineAcceptance,
    /// `acc_i` per step (offline).
    pub offline_acc: Vec<f64>,
    /// Offline conditional acceptance per draft position.
    pub offline_per_position: Vec<f64>,
    /// Offline implied accept length.
    pub offline_accept_length: f64,
    /// Online statistics.
    pub online: OnlineAcceptance,
    /// Online conditional acceptance per draft position.
    pub online_per_position: Vec<f64>,
    /// Online accept length.
    pub online_accept_length: f64,
    /// `offline_per_position - online_per_position`.
    pub gap: Vec<f64>,
    /// A position whose gap exceeds this is flagged.
    pub threshold: f64,
    /// Whether any position is flagged.
    pub flagged: bool,
    /// One sentence per flagged position, or a sentence saying the two agree.
    pub verdict: Vec<String>,
}

impl CompareReport {
    /// Puts offline and online side by side and flags positions whose offline acceptance
    /// exceeds the online one by more than `threshold`.
    pub fn new(
        labels: [String; 3],
        steps: usize,
        offline: OfflineAcceptance,
        online: OnlineAcceptance,
        threshold: f64,
    ) -> Self {
        let [dump, head, prompts] = labels;
        let offline_per_position = offline.per_position();
        let mut online_per_position = online.stats.per_position();
        online_per_position.resize(steps, 0.0);
        let gap: Vec<f64> = offline_per_position
            .iter()
            .zip(&online_per_position)
            .map(|(a, b)| a - b)
            .collect();
        let mut verdict = Vec::new();
        for (i, g) in gap.iter().enumerate() {
            if *g > threshold {
                verdict.push(format!(
                    "draft position {i}: offline acceptance {:.3} but online {:.3} (gap {g:.3} > \
                     {threshold}): the head is served something other than it was trained on \
                     (taps, template or tokenizer); run `tandem replay --dump {dump} --head \
                     {head}`",
                    offline_per_position[i], online_per_position[i]
                ));
            }
        }
        let flagged = !verdict.is_empty();
        if !flagged {
            verdict.push(format!(
                "offline and online acceptance agree within {threshold} at every position"
            ));
        }
        CompareReport {
            dump,
            head,
            prompts,
            steps,
            offline_acc: offline.acc(),
            offline_per_position,
            offline_accept_length: offline.implied_accept_length(),
            offline,
            online_accept_length: online.stats.accept_length(),
            online_per_position,
            online,
            gap,
            threshold,
            flagged,
            verdict,
        }
    }

    /// Terminal table.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "compare {} on {} ({} samples) vs {} ({} prompts, {} tokens), chain of {} drafts",
            self.head,
            self.dump,
            self.offline.samples,
            self.prompts,
            self.online.prompts,
            self.online.tokens,
            self.steps
        );
        let _ = writeln!(out, "pos  offline acc_i  offline chain  online  gap");
        for i in 0..self.steps {
            let _ = writeln!(
                out,
                "{i:<3}  {:<13.3}  {:<13.3}  {:<6.3}  {:+.3}",
                self.offline_acc[i],
                self.offline_per_position[i],
                self.online_per_position[i],
                self.gap[i]
            );
        }
        let _ = writeln!(
            out,
            "accept length: offline (implied) {:.3}, online {:.3}",
            self.offline_accept_length, self.online_accept_length
        );
        for v in &self.verdict {
            let _ = writeln!(out, "{}: {v}", if self.flagged { "FLAG" } else { "ok" });
        }
        out
    }

    /// Self-contained HTML with an inline SVG plot of acceptance per position.
    pub fn to_html(&self) -> String {
        let mut b = String::new();
        let _ = write!(
            b,
            "<h1>Tandem compare <span class=\"badge {}\">{}</span></h1><p>Head <code>{}</code>, \
             dump <code>{}</code> ({} samples, offline: teacher-forced TTT), prompts <code>{}</code> \
             ({} prompts, {} tokens, online: chain of {} drafts, greedy).</p>",
            if self.flagged { "bad" } else { "ok" },
            if self.flagged {
                "gap flagged"
            } else {
                "consistent"
            },
            escape(&self.head),
            escape(&self.dump),
            self.offline.samples,
            escape(&self.prompts),
            self.online.prompts,
            self.online.tokens,
            self.steps
        );
        b.push_str(&self.svg());
        b.push_str(
            "<table><tr><th>position</th><th>offline acc_i</th><th>offline chain</th>\
             <th>online</th><th>gap</th></tr>",
        );
        for i in 0..self.steps {
            let class = if self.gap[i] > self.threshold {
                "bad"
            } else {
                "ok"
            };
            let _ = write!(
                b,
                "<tr><td>{i}</td><td>{:.3}</td><td>{:.3}</td><td>{:.3}</td>\
                 <td class={class}>{:+.3}</td></tr>",
                self.offline_acc[i],
                self.offline_per_position[i],
                self.online_per_position[i],
                self.gap[i]
            );
        }
        let _ = write!(
            b,
            "</table><p>Accept length: offline (implied) {:.3}, online {:.3}.</p><ul>",
            self.offline_accept_length, self.online_accept_length
        );
        for v in &self.verdict {
            let _ = write!(b, "<li>{}</li>", escape(v));
        }
        b.push_str("</ul>");
        html_page("Tandem compare", &b)
    }

    fn svg(&self) -> String {
        let (w, h, pad) = (520.0, 260.0, 40.0);
        let n = self.steps.max(1);
        let x = |i: usize| {
            if n == 1 {
                pad + (w - 2.0 * pad) / 2.0
            } else {
                pad + (w - 2.0 * pad) * i as f64 / (n - 1) as f64
            }
        };
        let y = |v: f64| h - pad - (h - 2.0 * pad) * v.clamp(0.0, 1.0);
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
             viewBox=\"0 0 {w} {h}\" role=\"img\"><rect width=\"{w}\" height=\"{h}\" \
             fill=\"#fff\"/>"
        );
        for k in 0..=4 {
            let v = f64::from(k) / 4.0;
            let _ = write!(
                s,
                "<line x1=\"{pad}\" x2=\"{}\" y1=\"{y0}\" y2=\"{y0}\" stroke=\"#e3e6ee\"/>\
                 <text x=\"6\" y=\"{}\" font-size=\"11\">{v:.2}</text>",
                w - pad,
                y(v) + 4.0,
                y0 = y(v)
            );
        }
        for i in 0..self.steps {
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">{i}</text>",
                x(i),
                h - pad + 16.0
            );
        }
        for (values, colour, label, dy) in [
            (
                &self.offline_per_position,
                "#1565c0",
                "offline (chain)",
                0.0,
            ),
            (&self.online_per_position, "#c62828", "online", 14.0),
        ] {
            let points: Vec<String> = values
                .iter()
                .enumerate()
                .map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v)))
                .collect();
            let _ = write!(
                s,
                "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>",
                points.join(" ")
            );
            for (i, v) in values.iter().enumerate() {
                let _ = write!(
                    s,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{colour}\"/>",
                    x(i),
                    y(*v)
                );
            }
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"{colour}\">{label}</text>",
                w - pad - 110.0,
                pad - 18.0 + dy
            );
        }
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"middle\">draft position</text></svg>",
            w / 2.0,
            h - 6.0
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-worked: n = 5, 2 steps, loss mask all on. argmax = [a0..a4] = [10, 11, 12, 13, 14].
    /// Step 0 at t predicts argmax[t+1]: proposals [11, 12, 99, 14, x] -> correct at t = 0, 1, 3
    /// (t = 4 has no next token) -> acc_0 = 3/4. Step 1 at t predicts argmax[t+2]: proposals
    /// [12, 99, 14, x, x] -> correct at t = 0, 2 of t = 0..2 -> acc_1 = 2/3.
    /// Chain positions t with t + 2 < 5: t = 0, 1, 2. t = 0: both correct (2 accepted);
    /// t = 1: step 0 correct, step 1 wrong (1); t = 2: step 0 wrong (0).
    /// reached = [3, 2], accepted = [2, 1]; implied tau = 1 + 3/3 = 2.
    #[test]
    fn offline_counts_by_hand() {
        let mut o = OfflineAcceptance::new(2);
        let draft = vec![vec![11, 12, 99, 14, 0], vec![12, 99, 14, 0, 0]];
        o.add_sample(&draft, &[10, 11, 12, 13, 14], &[1; 5]);
        assert_eq!(
            (o.correct.clone(), o.denominators.clone()),
            (vec![3, 2], vec![4, 3])
        );
        assert_eq!(
            (o.reached.clone(), o.accepted.clone()),
            (vec![3, 2], vec![2, 1])
        );
        assert_eq!(o.chain_positions, 3);
        assert!((o.implied_accept_length() - 2.0).abs() < 1e-12);
        assert_eq!(o.per_position(), vec![2.0 / 3.0, 0.5]);
    }

    #[test]
    fn a_large_gap_is_flagged() {
        let mut o = OfflineAcceptance::new(2);
        let draft = vec![vec![11, 12, 13, 14, 0], vec![12, 13, 14, 0, 0]];
        o.add_sample(&draft, &[10, 11, 12, 13, 14], &[1; 5]);
        let mut stats = AcceptanceStats::new(2);
        for _ in 0..10 {
            stats.record(0, 2);
        }
        let online = OnlineAcceptance {
            prompts: 1,
            tokens: 10,
            stats,
        };
        let labels = ["d".to_owned(), "h".to_owned(), "p".to_owned()];
        let r = CompareReport::new(labels, 2, o, online, 0.2);
        assert!(r.flagged);
        assert!(
            r.verdict[0].starts_with("draft position 0: offline acceptance 1.000 but online 0.000")
        );
        assert!(r.to_html().contains("<svg"));
    }
}
