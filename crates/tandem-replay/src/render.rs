//! The replay report for people: a terminal table and a self-contained HTML page (inline CSS,
//! no scripts, no external assets).

use std::fmt::Write as _;

use tandem_wiring::format_taps;

use crate::report::{Level, ReplayReport, Status};

/// Escapes text for HTML element content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Shared inline style of Tandem's HTML reports.
pub const STYLE: &str = "body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;\
margin:2em;color:#1d2330;max-width:1200px}h1{font-size:1.5em}h2{font-size:1.15em;\
margin-top:1.6em;border-bottom:1px solid #dde}table{border-collapse:collapse;margin:.5em 0}\
td,th{border:1px solid #ccd;padding:.25em .5em;text-align:left;vertical-align:top;\
font-size:.9em}th{background:#f0f2f7}code,.mono{font-family:ui-monospace,Menlo,Consolas,\
monospace}.ok{color:#176b2c;font-weight:600}.bad{color:#b3261e;font-weight:600}\
.warn{color:#8a5a00;font-weight:600}.info{color:#555}.badge{display:inline-block;\
padding:.2em .7em;border-radius:1em;color:#fff}.badge.ok{background:#2e7d32}\
.badge.bad{background:#c62828}.heat td{padding:0;width:1.3em;height:1.3em;border:1px solid #fff}\
.heat th{font-weight:normal;font-size:.7em;writing-mode:vertical-rl;white-space:nowrap}\
.heat th.row{writing-mode:horizontal-tb}ul{padding-left:1.2em}li{margin:.25em 0}\
.small{font-size:.85em;color:#555}";

/// A complete HTML page around `body`.
pub fn html_page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{}</title><style>{STYLE}</style></head><body>\n{body}\n</body></html>\n",
        escape(title)
    )
}

fn level_word(level: Level) -> &'static str {
    match level {
        Level::Error => "error",
        Level::Warning => "warning",
        Level::Info => "info",
    }
}

fn fmt_opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

impl ReplayReport {
    /// The terminal form: a header, one table row per slot, the findings, the result line.
    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "replay of {} through {} [{}]: {} sample(s), {} tokens; match = cosine >= {} and \
             rel err <= {:.0e}",
            self.dump,
            self.model,
            self.device,
            self.samples,
            self.tokens,
            self.tolerance.min_cosine,
            self.tolerance.max_rel_err
        );
        let _ = writeln!(
            out,
            "manifest taps {}{}; serving taps {} from {}",
            format_taps(&self.manifest_taps),
            self.raw_ids
                .as_ref()
                .map(|r| format!(" (requested as {r})"))
                .unwrap_or_default(),
            format_taps(&self.serving_taps),
            self.serving_basis
        );
        let header = [
            "slot",
            "manifest",
            "serving",
            "best match",
            "cosine",
            "rel err",
            "normed",
            "verdict",
        ];
        let rows: Vec<[String; 8]> = self
            .slots
            .iter()
            .map(|s| {
                [
                    s.slot.to_string(),
                    s.manifest_tap.to_string(),
                    fmt_opt(s.serving_tap),
                    s.best.map_or_else(
                        || "-".to_owned(),
                        |b| match b.shard {
                            Some(sh) => format!("{} [shard {}/{}]", b.candidate, sh.index, sh.of),
                            None => b.candidate.to_string(),
                        },
                    ),
                    s.best
                        .map_or_else(|| "-".to_owned(), |b| format!("{:.6}", b.cosine)),
                    s.best
                        .map_or_else(|| "-".to_owned(), |b| format!("{:.2e}", b.rel_err)),
                    if s.normed { "yes" } else { "no" }.to_owned(),
                    s.verdict.clone(),
                ]
            })
            .collect();
        let mut widths = header.map(str::len);
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row).take(7) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut l = String::new();
            for (i, cell) in cells.iter().enumerate() {
                if i < 7 {
                    let _ = write!(l, "{cell:<w$}  ", w = widths[i]);
                } else {
                    l.push_str(cell);
                }
            }
            l
        };
        let _ = writeln!(out, "{}", line(&header.map(str::to_owned)));
        for row in &rows {
            let _ = writeln!(out, "{}", line(row));
        }
        if let Some(lh) = &self.last_hidden {
            let _ = writeln!(
                out,
                "last_hidden: manifest {}, best {} -> {}",
                lh.manifest_tap,
                lh.best.short(),
                if lh.status == Status::Match {
                    "match"
                } else {
                    "mismatch"
                }
            );
        }
        for f in &self.findings {
            let _ = writeln!(
                out,
                "{:<7} [{}] {}",
                level_word(f.level),
                f.topic,
                f.message
            );
        }
        let problems = self.problems();
        if problems.is_empty() {
            let _ = writeln!(out, "result: every slot matches; the wiring is consistent");
        } else {
            let _ = writeln!(
                out,
                "result: {} problem(s): {} slot mismatch(es), {} error finding(s)",
                problems.len(),
                self.mismatched_slots().len(),
                self.errors().len()
            );
        }
        out
    }

    /// A self-contained HTML page: verdict badge, findings, the slot table and a heat map of
    /// every slot's cosine similarity to every candidate.
    pub fn to_html(&self) -> String {
        let mut b = String::new();
        let ok = self.ok();
        let _ = write!(
            b,
            "<h1>Tandem replay <span class=\"badge {}\">{}</span></h1>",
            if ok { "ok" } else { "bad" },
            if ok {
                "consistent".to_owned()
            } else {
                format!("{} problem(s)", self.problems().len())
            }
        );
        let _ = write!(
            b,
            "<table><tr><th>dump</th><td class=mono>{}</td></tr><tr><th>model</th>\
             <td class=mono>{}</td></tr><tr><th>head</th><td class=mono>{}</td></tr>\
             <tr><th>device</th><td>{}</td></tr><tr><th>replayed</th><td>{} sample(s), {} \
             tokens</td></tr><tr><th>target</th><td>{} blocks, T = {}</td></tr>\
             <tr><th>manifest taps</th><td>{}{}</td></tr><tr><th>serving taps</th><td>{} \
             <span class=small>({})</span></td></tr><tr><th>tolerance</th><td>cosine &ge; {} \
             and relative error (max |dump &minus; recomputed| / max |recomputed|) &le; {:.0e}, \
             over all tokens</td></tr></table>",
            escape(&self.dump),
            escape(&self.model),
            escape(self.head.as_deref().unwrap_or("none")),
            escape(&self.device),
            self.samples,
            self.tokens,
            self.num_layers,
            self.hidden_size,
            escape(&format_taps(&self.manifest_taps)),
            self.raw_ids
                .as_ref()
                .map(|r| format!(
                    " <span class=small>(requested as <code>{}</code>)</span>",
                    escape(r)
                ))
                .unwrap_or_default(),
            escape(&format_taps(&self.serving_taps)),
            escape(&self.serving_basis),
            self.tolerance.min_cosine,
            self.tolerance.max_rel_err,
        );
        b.push_str(
            "<h2>Slots</h2><table><tr><th>slot</th><th>width</th><th>manifest</th>\
                    <th>serving</th><th>best match</th><th>cosine</th><th>rel err</th>\
                    <th>min token cos</th><th>vs manifest tap</th><th>norm mean / cv</th>\
                    <th>zero tokens</th><th>verdict</th></tr>",
        );
        for s in &self.slots {
            let class = if s.status == Status::Match {
                "ok"
            } else {
                "bad"
            };
            let (best, cos, rel, minc) = match s.best {
                Some(b) => (
                    b.short(),
                    format!("{:.6}", b.cosine),
                    format!("{:.2e}", b.rel_err),
                    format!("{:.5}", b.min_token_cosine),
                ),
                None => ("-".into(), "-".into(), "-".into(), "-".into()),
            };
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td>{}</td><td>{:.2} / {:.3}{}</td><td>{} / {}</td>\
                 <td class={class}>{}</td></tr>",
                s.slot,
                s.width,
                escape(&s.manifest_tap.to_string()),
                escape(&fmt_opt(s.serving_tap)),
                escape(&best),
                cos,
                rel,
                minc,
                escape(
                    &s.manifest_score
                        .map_or_else(|| "-".to_owned(), |m| m.short())
                ),
                s.mean_norm,
                s.norm_cv,
                if s.normed { " <b>normed</b>" } else { "" },
                s.zero_tokens,
                s.tokens,
                escape(&s.verdict)
            );
        }
        b.push_str("</table>");
        if let Some(lh) = &self.last_hidden {
            let _ = write!(
                b,
                "<p>last_hidden: manifest says {}, best match {} &rarr; <span class={}>{}</span></p>",
                escape(&lh.manifest_tap.to_string()),
                escape(&lh.best.short()),
                if lh.status == Status::Match {
                    "ok"
                } else {
                    "bad"
                },
                if lh.status == Status::Match {
                    "match"
                } else {
                    "mismatch"
                }
            );
        }
        b.push_str("<h2>Findings</h2><ul>");
        for f in &self.findings {
            let class = match f.level {
                Level::Error => "bad",
                Level::Warning => "warn",
                Level::Info => "info",
            };
            let _ = write!(
                b,
                "<li><span class={class}>{}</span> <code>{}</code> {}</li>",
                level_word(f.level),
                f.topic,
                escape(&f.message)
            );
        }
        b.push_str("</ul>");
        b.push_str(
            "<h2>Cosine similarity of each slot to every candidate</h2><p class=small>Dark \
             green: cosine &ge; tolerance; the outlined cell is the manifest's tap.</p>\
             <table class=heat><tr><th class=row></th>",
        );
        for c in &self.candidates {
            let _ = write!(b, "<th>{}</th>", escape(&c.to_string()));
        }
        b.push_str("</tr>");
        for (slot, row) in self.cosine.iter().enumerate() {
            let _ = write!(b, "<tr><th class=row>slot {slot}</th>");
            let declared = self.manifest_taps.get(slot).copied();
            for (c, &v) in self.candidates.iter().zip(row) {
                let colour = heat_colour(v, self.tolerance.min_cosine);
                let outline = if declared.is_some_and(|d| c.tap() == Some(d)) {
                    ";outline:2px solid #1d2330"
                } else {
                    ""
                };
                let _ = write!(
                    b,
                    "<td style=\"background:{colour}{outline}\" title=\"slot {slot} vs {}: cosine {v:.6}\"></td>",
                    escape(&c.to_string())
                );
            }
            b.push_str("</tr>");
        }
        b.push_str("</table>");
        html_page("Tandem replay", &b)
    }
}

/// White (cosine <= 0) to pale green, and dark green once within tolerance.
fn heat_colour(cosine: f64, threshold: f64) -> String {
    if cosine >= threshold {
        return "#1b7f3b".to_owned();
    }
    let t = cosine.clamp(0.0, 1.0);
    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(255.0, 150.0),
        mix(255.0, 215.0),
        mix(255.0, 160.0)
    )
}
